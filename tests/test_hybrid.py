"""Hybrid sharding (``shard_group_size``, FSDP's HYBRID_SHARD) and reshard_after_forward: the core's policy
for shard groups and replica groups, owned by this file. One process checks the options against the world
size; 4 gloo ranks check parity with plain PyTorch and the bytes per group kind.

The 4 ranks are 2 simulated nodes of 2 (LOCAL_WORLD_SIZE=2, as ``xshard launch --nnodes 2 --nproc 2``
sets it): shard groups [0 1] [2 3], replica groups [0 2] [1 3]. Every case trains TinyLM (sizes that
do not divide by 2 or 4: shards are padded) for 3 steps and matches a single-process run on the global
batch (fp32, atol 1e-5); replicas must hold identical shards.

Bytes per step (ZeRO-paper convention, psi_N = parameter bytes padded to N dim-0 shards, ``flags`` =
one element per trainable parameter in each reduce):

- shard group of G ranks: ``all_gather`` psi_G (stage 2) or 2 psi_G - psi_G,root (stage 3),
  ``reduce_scatter`` psi_G,trainable + flags x G;
- replica group: ``all_reduce_inter`` 2 (psi_G,trainable / G + flags): each rank's reduced shard;
- ``reshard_after_forward=k``: ``all_gather`` psi_G (forward only) and ``all_gather_post_forward``
  psi_k - psi_k,root (backward, within groups of k ranks).
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.models import make_tiny
from support.sharding_harness import assert_matches, case, reference, run_cases
from test_sharding_accounting import ROOT, psi_bytes

from xshard.sharding import ShardingOptions

WORLD, NODE = 4, 2
FP32_ATOL = 1e-5
HYBRID = dict(shard_group_size=NODE)

CASES = {
    "hybrid-3": case(stage=3, options=HYBRID),
    "hybrid-2": case(stage=2, options=HYBRID),
    "hybrid-1": case(stage=1, options=HYBRID, micro=2),
    # FSDP's names: the size comes from LOCAL_WORLD_SIZE
    "HYBRID_SHARD": case(stage="HYBRID_SHARD"),
    "_HYBRID_SHARD_ZERO2": case(stage="_HYBRID_SHARD_ZERO2"),
    # frozen parameters, accumulation, global-norm clipping (the norm spans one shard group)
    "hybrid-3-features": case(stage=3, options=HYBRID, frozen=True, micro=2, clip=0.05),
    # reshard_after_forward variants
    "hybrid-3-keep": case(stage=3, options=dict(HYBRID, reshard_after_forward=False)),
    "stage-2-reshard": case(stage=2, options=dict(reshard_after_forward=True)),
    "stage-3-reshard-to-2": case(stage=3, options=dict(reshard_after_forward=2), reuse=True),
    # a model built inside sharded_init: each rank rebuilds its rows of the normal init
    "hybrid-3-sharded-init": case(stage=3, options=HYBRID, sharded_init=True),
}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    per_rank = run_workers(run_cases, WORLD, list(CASES.values()), env={"LOCAL_WORLD_SIZE": str(NODE)},
                           timeout=270)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CASES)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_and_reshard_variants_match_plain_pytorch(results, name) -> None:
    res = results[name]
    assert_matches(res, reference(CASES[name]), FP32_ATOL, label=name)
    groups = {"hybrid-3-keep": NODE, "stage-2-reshard": WORLD, "stage-3-reshard-to-2": WORLD}
    assert res[0]["stats"]["shard_group_size"] == groups.get(name, NODE)
    # every replica holds the same rows with the same values
    size = res[0]["stats"]["shard_group_size"]
    for rank in range(size, WORLD):
        twin = res[rank % size]["pieces"]
        assert res[rank]["pieces"].keys() == twin.keys()
        for key, value in res[rank]["pieces"].items():
            assert torch.equal(value, twin[key]), (name, rank, key)


def _flags(model: torch.nn.Module) -> int:
    return 4 * sum(1 for p in dict.fromkeys(model.parameters()) if p.requires_grad)


@pytest.mark.multiprocess
def test_bytes_per_group_kind_match_the_formulas(results) -> None:
    model = make_tiny()
    psi_g, psi_g_root = psi_bytes(model, NODE), psi_bytes(model, NODE, names=ROOT)
    n_flags = _flags(model)
    reduce_scatter = psi_g + n_flags * NODE
    inter = 2 * (psi_g // NODE + n_flags)
    for name, gather in (("hybrid-3", 2 * psi_g - psi_g_root), ("HYBRID_SHARD", 2 * psi_g - psi_g_root),
                         ("hybrid-2", psi_g), ("_HYBRID_SHARD_ZERO2", psi_g), ("hybrid-3-keep", psi_g)):
        for rank_result in results[name]:
            for step in rank_result["comm"]:
                assert step["bytes"] == {"all_gather": gather, "reduce_scatter": reduce_scatter,
                                         "all_reduce_inter": inter}, name
                assert step["calls"]["all_reduce_inter"] == step["calls"]["reduce_scatter"]  # one per unit
    # inter-node traffic is 1/G of a reduce-scatter's worth, twice (an all-reduce of the reduced shards)
    assert inter == 2 * (psi_g + n_flags * NODE) // NODE

    # reshard_after_forward=2 with G=4: forward gathers over 4 ranks, backward within groups of 2
    psi_4, psi_2, psi_2_root = psi_bytes(model, WORLD), psi_bytes(model, NODE), psi_bytes(model, NODE, names=ROOT)
    for rank_result in results["stage-3-reshard-to-2"]:
        for step in rank_result["comm"]:
            # blocks[0] runs twice per forward (reuse): its second forward gathers its post-forward pieces
            block0 = psi_bytes(model, NODE, names=[k for k in dict(model.named_parameters()) if k.startswith("blocks.0.")])
            assert step["bytes"] == {"all_gather": psi_4, "all_gather_post_forward": psi_2 - psi_2_root + block0,
                                     "reduce_scatter": psi_4 + n_flags * WORLD}
    # stage 2 freeing after forward gathers like stage 3
    psi_4_root = psi_bytes(model, WORLD, names=ROOT)
    for rank_result in results["stage-2-reshard"]:
        for step in rank_result["comm"]:
            assert step["bytes"] == {"all_gather": 2 * psi_4 - psi_4_root, "reduce_scatter": psi_4 + n_flags * WORLD}


def test_hybrid_and_reshard_options_are_checked_against_the_world() -> None:
    from xshard.sharding import ReshardAfterForward, ShardingPlan

    plan = ShardingPlan.from_options(ShardingOptions(stage="HYBRID_SHARD"), world_size=16, local_world_size=8)
    assert (plan.stage, plan.shard_group_size, plan.replicas) == (3, 8, 2)
    plan = ShardingPlan.from_options(ShardingOptions(stage=3, reshard_after_forward=4), world_size=16)
    assert plan.reshard_after_forward == ReshardAfterForward(True, post_forward_group_size=4)
    # FSDP2's edge values: a group of one keeps the whole parameter, the whole shard group is True
    assert ShardingPlan.from_options(ShardingOptions(stage=3, reshard_after_forward=1), 8).reshard_after_forward \
        == ReshardAfterForward(False)
    assert ShardingPlan.from_options(ShardingOptions(stage=3, reshard_after_forward=8), 8).reshard_after_forward \
        == ReshardAfterForward(True)
    assert not ShardingPlan.from_options(ShardingOptions(stage=3, reshard_after_forward=False), 8) \
        .reshard_after_forward.frees
    with pytest.raises(ValueError, match="shard_group_size=3 must divide the world size 8"):
        ShardingPlan.from_options(ShardingOptions(stage=3, shard_group_size=3), world_size=8)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=8"):
        ShardingPlan.from_options(ShardingOptions(stage=2, shard_group_size="node"), 8, local_world_size=3)
    with pytest.raises(ValueError, match="reshard_after_forward=3 must divide the shard group size 4"):
        ShardingPlan.from_options(ShardingOptions(stage=3, shard_group_size=4, reshard_after_forward=3), 8)
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        ShardingPlan.from_options(ShardingOptions(stage=0, shard_group_size=2), world_size=4)
    with pytest.raises(ValueError, match="shard_group_size='half' is not valid"):
        ShardingOptions(shard_group_size="half")
    with pytest.raises(ValueError, match="reshard_after_forward=0 is not valid"):
        ShardingOptions(reshard_after_forward=0)
