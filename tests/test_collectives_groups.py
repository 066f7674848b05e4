"""Subgroup collectives (``Backend.group_collectives``) on 4 real gloo ranks: values inside each group,
one byte counter and one trace for the whole job (kinds suffixed per group), groups made once.

Groups as hybrid sharding makes them on 2 nodes of 2: shard groups [0 1] [2 3] (inside a node) and
replica groups [0 2] [1 3] (across nodes).
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

SHARD_GROUPS = [[0, 1], [2, 3]]
REPLICA_GROUPS = [[0, 2], [1, 3]]


def _exercise(rank: int, world_size: int) -> dict:
    from xshard.backends import get_backend

    backend = get_backend("cpu")
    backend.init_process_group(timeout=60)
    world = backend.collectives
    shard = backend.group_collectives(SHARD_GROUPS)
    inter = backend.group_collectives(REPLICA_GROUPS, "_inter")
    out: dict = {"same_object": backend.group_collectives(SHARD_GROUPS) is shard,
                 "whole_world": backend.group_collectives([[0, 1, 2, 3]]) is world,
                 "places": (shard.rank, shard.world_size, inter.rank, inter.world_size)}
    gathered = torch.empty(4)
    shard.all_gather_into_tensor(gathered, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    out["gathered"] = gathered
    mine = torch.empty(2)
    shard.reduce_scatter_tensor(mine, torch.arange(4.0) + rank, op="avg")
    out["scattered"] = mine
    t = torch.tensor([float(rank)])
    inter.all_reduce(t, op="sum")
    out["inter_sum"] = t
    b = torch.tensor([float(rank)])
    inter.broadcast(b, src=1)
    out["inter_broadcast"] = b
    world.verify_same_collectives()  # every rank issued the same subgroup collectives: passes
    out["counter"] = world.counter.snapshot()
    with pytest.raises(ValueError, match="must split the ranks 0..3 into disjoint"):
        backend.group_collectives([[0, 1], [1, 2, 3]])
    backend.destroy_process_group()
    return out


def test_subgroup_collectives_values_and_one_counter() -> None:
    results = run_workers(_exercise, 4)
    for rank, res in enumerate(results):
        group = SHARD_GROUPS[rank // 2]
        assert res["same_object"] and res["whole_world"]
        assert res["places"] == (rank % 2, 2, rank // 2, 2)
        assert torch.equal(res["gathered"], torch.tensor([v for r in group for v in (10.0 * r, 10.0 * r + 1)]))
        full = sum(torch.arange(4.0) + r for r in group) / 2  # the average over this rank's shard group only
        assert torch.equal(res["scattered"], full[(rank % 2) * 2:(rank % 2) * 2 + 2])
        assert res["inter_sum"].item() == sum(REPLICA_GROUPS[rank % 2])
        assert res["inter_broadcast"].item() == REPLICA_GROUPS[rank % 2][1]
        # the subgroups count into the job's counter, the replica group's kinds suffixed "_inter"
        assert res["counter"]["bytes"] == {"all_gather": 16, "reduce_scatter": 16, "all_reduce_inter": 8,
                                           "broadcast_inter": 4}
