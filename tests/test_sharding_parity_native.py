"""Parity through the collective setup the CUDA, NPU and TPU backends declare, trained on gloo.

Every other parity file trains through the CPU backend's own collectives (reduce-scatter by
point-to-point exchange, all-gather as broadcasts, small tensors packed, AVG as SUM then divide).
The device backends declare another setup: the process group's own reduce-scatter and all-gather
over one packed buffer per unit, and ReduceOp.AVG itself where the library has it (NCCL, HCCL) or
SUM then divide (torch_xla's and TorchTPU's process groups, MPS). That code is ``DistCollectives``
on every c10d backend, and gloo accepts all of those calls, so this file runs the parity matrix
through it on 4 gloo ranks (2 simulated nodes of 2, for the hybrid cases): every stage, gradient
accumulation, SGD without clipping, clipping, bf16 and fp16 with fp16 reduces, hybrid sharding.
Each case compares losses, every step's gradient norms and the final weights with plain PyTorch on
the full batch (``support/sharding_harness.py``), so a wrong average (a SUM, a missing or doubled
divide) fails here for the setup that has it.

One run per distinct declared setup (``SETUPS``): the backends that declare the same one are
covered by the same run, and a backend that declares a new one adds a run by itself.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.sharding_harness import assert_matches, case, reference, run_cases_by_forms

from xshard.backends import backend_class

pytestmark = pytest.mark.multiprocess

WORLD, NODE = 4, 2
FP32_ATOL = 1e-5
LOW_PRECISION_TOL = 2e-2  # as test_sharding_parity.py's mixed cases: bf16 rounds at 4e-3 per operation
DEVICE_BACKENDS = ("cuda", "npu", "tpu", "mps")


def declared_setup(name: str) -> tuple[bool, tuple[tuple[str, object], ...]]:
    """(native AVG?, the collective options) that backend ``name`` builds its DistCollectives with."""
    cls = backend_class(name)
    return cls.native_avg, tuple(sorted(cls.collective_options(None).items()))  # type: ignore[arg-type]


#: one backend per distinct declared setup: the name the run goes by -> every backend declaring it
SETUPS: dict[str, list[str]] = {}
for _name in DEVICE_BACKENDS:
    _first = next((k for k in SETUPS if declared_setup(k) == declared_setup(_name)), _name)
    SETUPS.setdefault(_first, []).append(_name)

HYBRID = dict(shard_group_size=NODE)
CASES: dict[str, dict] = {
    **{f"stage-{s}": case(stage=s) for s in (0, 1, 2, 3)},
    **{f"stage-{s}-accumulate": case(stage=s, micro=2) for s in (0, 2, 3)},
    "stage-3-sgd": case(stage=3, optimizer="sgd"),  # no clipping, no Adam: a scale shows in the weights
    "stage-2-clip": case(stage=2, micro=2, clip=0.05, frozen=True),
    "hybrid-3": case(stage=3, options=HYBRID),
    "hybrid-2-accumulate": case(stage=2, options=HYBRID, micro=2),
    "bf16-3": case(stage=3, optimizer="sgd", options=dict(param_dtype=torch.bfloat16)),
    # fp16 reduce over 4 ranks: SUM with a pre-divide by 2 and a post-divide by 2 on every setup
    "fp16-2": case(stage=2, optimizer="sgd", options=dict(param_dtype=torch.float16, reduce_dtype=torch.float16)),
}
LOW_PRECISION = {"bf16-3", "fp16-2"}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, list[dict]]]:
    by_forms = {forms: list(CASES.values()) for forms in SETUPS}
    per_rank = run_workers(run_cases_by_forms, WORLD, by_forms, env={"LOCAL_WORLD_SIZE": str(NODE)}, timeout=270)
    return {forms: {name: [r[forms][i] for r in per_rank] for i, name in enumerate(CASES)} for forms in SETUPS}


def test_the_runs_cover_every_device_backends_declared_setup() -> None:
    """The runs below are one per distinct setup; today: native AVG (CUDA, NPU) and SUM then divide
    (TPU, MPS), both with the process group's own reduce-scatter and all-gather."""
    covered = sorted(name for names in SETUPS.values() for name in names)
    assert covered == sorted(DEVICE_BACKENDS)
    setups = {declared_setup(k) for k in SETUPS}
    assert (True, ()) in setups and (False, ()) in setups, setups


@pytest.mark.parametrize("forms", list(SETUPS))
@pytest.mark.parametrize("name", list(CASES))
def test_declared_collectives_train_as_plain_pytorch(results, forms, name) -> None:
    tol = LOW_PRECISION_TOL if name in LOW_PRECISION else FP32_ATOL
    rtol = LOW_PRECISION_TOL if name in LOW_PRECISION else 0.0
    assert_matches(results[forms][name], reference(CASES[name]), atol=tol, rtol=rtol,
                   label=f"{name} through {'/'.join(SETUPS[forms])}'s collectives")


@pytest.mark.parametrize("forms", list(SETUPS))
def test_the_runs_went_through_the_declared_collectives(results, forms) -> None:
    """Each rank's shard group ran the declared setup: the process group's own reduce-scatter and
    all-gather (not the CPU backend's exchange and broadcasts), and the declared AVG."""
    native_avg = backend_class(forms).native_avg
    for name in CASES:
        for rank_result in results[forms][name]:
            assert rank_result["collectives"] == {"native_avg": native_avg, "reduce_scatter_form": "native",
                                                  "all_gather_via_broadcast": False}, name
