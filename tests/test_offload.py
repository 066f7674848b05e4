"""CPU offload (``offload_params``, ``offload_optimizer``): the core's offload policy, owned by this file.

Offloaded training must equal plain PyTorch on the full batch, as every other sharded run does: the 2-rank
cases run in the parity job shared with ``test_sharding_parity.py`` (``support/parity_world.py``) and are
checked at fp32's atol 1e-5. Stage 0 keeps a full replica on every device, so it has nothing to offload and
says so.

Elsewhere: the offloaded bytes per rank are part of the state-bytes accounting of
``test_sharding_accounting.py``; ``xshard estimate --offload`` in ``test_estimate.py``; the config spellings
(DeepSpeed's ``offload_*``, FSDP's ``cpu_offload``) in the config and Accelerate-compatibility tests.
"""

from __future__ import annotations

import pytest
from support.models import make_tiny
from support.parity_world import check_group
from support.sharding_harness import case

from xshard.sharding import ShardingOptions, shard_model

FP32_ATOL = 1e-5

WORLD2_GROUPS = {
    # CPU offload of parameter shards, gradients and optimizer state
    "offload": [case(stage=3, options=dict(offload_params=True)), case(stage=2, options=dict(offload_optimizer=True))],
}


@pytest.mark.multiprocess
def test_offloaded_training_matches_single_process(world2) -> None:
    check_group(WORLD2_GROUPS["offload"], world2["offload"], "offload", atol=FP32_ATOL)


def test_stage0_refuses_offload(cpu_backend) -> None:
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        shard_model(make_tiny(), cpu_backend, ShardingOptions(stage=0, offload_params=True))
