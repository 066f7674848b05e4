"""Activation checkpointing per unit: the core's checkpointing policy, owned by this file.

Three ways a unit's activations are recomputed in backward instead of kept, each trained on 2 gloo ranks
and compared with plain PyTorch on the full batch (fp32, atol 1e-5): xshard's own
``activation_checkpointing=True`` (every unit's forward under ``torch.utils.checkpoint``; also on nested
units and on a tiny Qwen2), the model calling its own blocks inside ``torch.utils.checkpoint``
(``checkpoint_calls``; also on a unit called twice per forward), and transformers' own
``gradient_checkpointing_enable`` (``hf_checkpointing``), which re-enters ``module.__call__`` in backward.
The cases run in the parity job shared with ``test_sharding_parity.py`` (``support/parity_world.py``).
"""

from __future__ import annotations

import pytest
from support.parity_world import check_group
from support.sharding_harness import case

pytestmark = pytest.mark.multiprocess

FP32_ATOL = 1e-5

WORLD2_GROUPS = {
    "tiny": [
        case(stage=3, options=dict(activation_checkpointing=True)),
        case(stage=3, checkpoint_calls=True), case(stage=2, checkpoint_calls=True, reuse=True),
        # nested units: a gated block (own gate + norm = 30 parameters) around its unit children up/down
        case(stage=3, policy="size", gated=True, options=dict(min_num_params=25, activation_checkpointing=True)),
    ],
    "qwen2": [
        case(stage=2, model="qwen2", options=dict(activation_checkpointing=True)),
        case(stage=3, model="qwen2", frozen=True, options=dict(activation_checkpointing=True), clip=0.5),
        case(stage=3, model="qwen2", hf_checkpointing=True),
    ],
}


def test_checkpointed_units_match_single_process(world2) -> None:
    check_group(WORLD2_GROUPS["tiny"], world2["tiny"], "tiny", atol=FP32_ATOL)
    # nested units: the gated block and its children up/down are units of their own
    nested = next(r for c, r in zip(WORLD2_GROUPS["tiny"], world2["tiny"], strict=True) if c["gated"])
    names = [name for name, _ in nested[0]["units"]]
    assert names == ["<root>"] + [f"blocks.{i}{part}" for i in range(3) for part in ("", ".up", ".down")]


def test_checkpointed_qwen2_matches_single_process(world2) -> None:
    check_group(WORLD2_GROUPS["qwen2"], world2["qwen2"], "qwen2", atol=FP32_ATOL)
