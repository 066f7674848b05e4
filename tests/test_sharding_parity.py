"""Parity: K steps sharded over N gloo ranks equal K steps of plain PyTorch on the full batch.

Every case trains TinyLM (dims 10/14/23: nothing divides by the world size, so shards are padded;
LM head tied to the embedding; AdamW with no decay on norms and biases) or a tiny Qwen2ForCausalLM,
and compares the rank-averaged losses, every step's per-parameter gradient norms (before clipping) and
the final full parameters with a single-process run. fp32 cases: atol 1e-5. Low-precision cases: see
``test_mixed_precision_matches``. ``test_a_wrong_gradient_scale_fails_the_comparison`` keeps the
comparison honest: the reference with its gradients 2x or 0.5x must not match.
CPU offload and activation checkpointing have files of their own (``test_offload.py``,
``test_activation_checkpointing.py``); their 2-rank cases run in the same job as this file's
(``support/parity_world.py``).
"""

from __future__ import annotations

import pytest
import torch
from support.parity_world import check_group, run_shared
from support.sharding_harness import assert_same_gradients, case, reference

pytestmark = pytest.mark.multiprocess

FP32_ATOL = 1e-5
BF16 = dict(param_dtype=torch.bfloat16)

# Every case of one world size runs in ONE spawned job (process start-up dominates; the 2-rank job is
# shared with the other parity files); the tests below each check their own group of cases against the
# single-process reference.
GROUPS: dict[str, list[dict]] = {
    "stages": [
        *[case(stage=s) for s in (0, 1, 2, 3)],
        case(stage=3, opt_before=True),  # optimizer built before shard_model: same result
        case(stage=2, opt_before=True, groups=False),
        # accumulation without clipping, and SGD (no Adam to cancel a scale), on every world size
        *[case(stage=s, micro=2) for s in (0, 1, 3)],
        case(stage=3, optimizer="sgd"), case(stage=0, optimizer="sgd", micro=2),
    ],
    "features": [
        # frozen parameters inside trained units, and a fully frozen first unit (no grad-requiring output)
        case(stage=3, frozen=True), case(stage=2, frozen=True), case(stage=0, frozen=True),
        case(stage=3, frozen_prefix=True, tie=False),
        # a unit called twice per forward
        case(stage=3, reuse=True), case(stage=2, reuse=True),
        # gradient accumulation with no_sync, and global-norm clipping (2-norm and inf-norm)
        case(stage=0, micro=2, clip=0.05), case(stage=1, micro=3, clip=0.05, frozen=True),
        case(stage=2, micro=2, clip=0.05), case(stage=3, micro=2, clip=0.05, clip_type=float("inf")),
        # prefetch variants, in-flight bound, other wrap policies
        case(stage=3, options=dict(forward_prefetch=True, backward_prefetch="post", max_inflight_all_gathers=3)),
        case(stage=3, options=dict(backward_prefetch="none", max_inflight_all_gathers=1)),
        case(stage=3, policy="size", options=dict(min_num_params=100)), case(stage=3, policy="none"),
        # nested units: a gated block (own gate + norm = 30 parameters) around its unit children up/down
        case(stage=2, policy="size", gated=True, micro=2, options=dict(min_num_params=25)),
        case(stage=1, options=dict(bucket_size_mb=0.001)),
        case(stage=0, options=dict(bucket_size_mb=0.001)),  # many stage-0 buckets, issued as they fill
    ],
    "qwen2": [
        case(stage=3, model="qwen2"),
    ],
    # low precision: SGD, because Adam would amplify rounding noise on near-zero gradients
    "mixed": [
        case(stage=3, optimizer="sgd", options=BF16),
        case(stage=2, optimizer="sgd", options=dict(BF16, keep_norms_fp32=True, reduce_dtype=torch.float32)),
        case(stage=1, optimizer="sgd", options=dict(param_dtype=torch.float16, reduce_dtype=torch.float16)),
        case(stage=3, model="qwen2", optimizer="sgd", options=dict(BF16, keep_norms_fp32=True)),
        case(stage=0, optimizer="sgd", micro=2, options=BF16),  # stage 0: fp32 master, bf16 compute copies
    ],
    # fp16 reduce at 4 ranks: SUM with a pre-divide by 2 and a post-divide by 2 (overflow guard)
    "fp16": [case(stage=2, optimizer="sgd", options=dict(param_dtype=torch.float16, reduce_dtype=torch.float16))],
}
WORLD2_GROUPS = GROUPS  # every group runs on 2 ranks (the ``world2`` fixture of conftest.py)
WORLD4 = ["stages", "fp16"]


@pytest.fixture(scope="module")
def world4() -> dict[str, list[list[dict]]]:
    return run_shared(4, {__name__: {g: GROUPS[g] for g in WORLD4}})[__name__]


def _check(group: str, results: dict, atol: float = FP32_ATOL, rtol: float = 0.0) -> None:
    check_group(GROUPS[group], results[group], group, atol=atol, rtol=rtol)


def test_every_stage_matches_single_process_2_ranks(world2) -> None:
    _check("stages", world2)


def test_every_stage_matches_single_process_4_ranks(world4) -> None:
    _check("stages", world4)


def test_features_match_single_process(world2) -> None:
    _check("features", world2)
    nested = next(r for c, r in zip(GROUPS["features"], world2["features"], strict=True) if c["gated"])
    names = [name for name, _ in nested[0]["units"]]
    assert names == ["<root>"] + [f"blocks.{i}{part}" for i in range(3) for part in ("", ".up", ".down")]


def test_qwen2_matches_single_process(world2) -> None:
    _check("qwen2", world2)
    # wrapped by Qwen2DecoderLayer (the model's _no_split_modules): root + 2 layers; tied head in the root
    units = world2["qwen2"][0][0]["units"]
    assert [name for name, _ in units] == ["<root>", "model.layers.0", "model.layers.1"]
    assert "model.embed_tokens.weight" in units[0][1] and "model.norm.weight" in units[0][1]


def test_fp16_reduce_4_ranks(world4) -> None:
    _check("fp16", world4, atol=2e-2, rtol=2e-2)


def test_mixed_precision_matches(world2) -> None:
    """bf16/fp16 compute with fp32 master shards, within 2e-2 (absolute and relative) of the fp32
    reference: bf16 keeps 8 bits of mantissa (relative rounding 4e-3 per operation)."""
    _check("mixed", world2, atol=2e-2, rtol=2e-2)
    # the all-gather moves half the bytes of fp32 (bf16 buffers); the reduce follows param_dtype too
    bf16_comm = world2["mixed"][0][0]["comm"][-1]["bytes"]
    fp32_comm = world2["stages"][3][0]["comm"][-1]["bytes"]
    assert bf16_comm == {k: v // 2 for k, v in fp32_comm.items()}


def test_bytes_per_step_2_ranks(world2) -> None:
    """The parity job's own byte counts follow the formulas of test_sharding_accounting.py."""
    from support.models import make_tiny
    from test_sharding_accounting import ROOT, flag_bytes, psi_bytes

    model = make_tiny()
    psi, psi_root = psi_bytes(model, 2), psi_bytes(model, 2, names=ROOT)
    rs = psi + flag_bytes(model, 2, "reduce_scatter")
    s0, s1, s2, s3 = ([c["bytes"] for c in world2["stages"][i][0]["comm"]] for i in range(4))
    assert s0 == [{"all_reduce": 2 * psi_bytes(model, 2, padded=False) + flag_bytes(model, 2, "all_reduce")}] * 3
    for s in (s1, s2):
        assert s == [{"all_gather": psi, "reduce_scatter": rs}] * 3  # 2 psi (+ flags)
    assert s3 == [{"all_gather": 2 * psi - psi_root, "reduce_scatter": rs}] * 3  # 3 psi - psi_root (+ flags)


@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_a_wrong_gradient_scale_fails_the_comparison(world2, scale) -> None:
    """The mutation a SUM in place of an AVG (2x on 2 ranks) or a divide done twice (0.5x) makes: every
    case of the "stages" group, compared with a reference whose gradients are scaled, must fail the
    gradient comparison, AdamW and accumulation included (AdamW alone trains to nearly the same losses
    and weights at any uniform scale, which is why the gradients are compared)."""
    for c, per_rank in zip(GROUPS["stages"], world2["stages"], strict=True):
        with pytest.raises(AssertionError, match="gradient norm"):
            assert_same_gradients(per_rank, reference(c, grad_scale=scale), atol=FP32_ATOL, label=f"x{scale} {c}")
