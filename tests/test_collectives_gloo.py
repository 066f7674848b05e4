"""Real collectives on gloo, world sizes 2 and 4: values, uneven sizes, async handles, byte counts."""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess


def _exercise(rank: int, world_size: int, numel: int) -> dict:
    from xshard.backends import get_backend

    backend = get_backend("cpu")
    backend.init_process_group(timeout=60)
    coll = backend.collectives
    out: dict = {}

    shard = torch.arange(numel, dtype=torch.float32) + 1000 * rank
    gathered = torch.empty(numel * world_size)
    coll.all_gather_into_tensor(gathered, shard)
    out["all_gather"] = gathered

    full = torch.arange(numel * world_size, dtype=torch.float32) * (rank + 1)
    mine = torch.empty(numel)
    coll.reduce_scatter_tensor(mine, full.clone(), op="sum")
    out["reduce_scatter_sum"] = mine.clone()
    handle = coll.reduce_scatter_tensor(mine, full.clone(), op="avg", async_op=True)
    out["reduce_scatter_avg"] = handle.wait().clone()

    t = torch.full((numel,), float(rank + 1))
    coll.all_reduce(t, op="avg")
    out["all_reduce_avg"] = t
    m = torch.tensor([float(rank)])
    coll.all_reduce(m, op="max")
    out["all_reduce_max"] = m

    b = torch.full((numel,), float(rank))
    coll.broadcast(b, src=world_size - 1)
    out["broadcast"] = b
    coll.barrier()
    out["counter"] = coll.counter.snapshot()
    backend.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size,numel", [(2, 5), (4, 3)])
def test_collectives_values_and_bytes(world_size: int, numel: int) -> None:
    results = run_workers(_exercise, world_size, numel)
    n = numel
    expected_gather = torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(world_size)])
    total = sum(r + 1 for r in range(world_size))
    for rank, res in enumerate(results):
        assert torch.equal(res["all_gather"], expected_gather)
        full_sum = torch.arange(n * world_size, dtype=torch.float32) * total
        assert torch.allclose(res["reduce_scatter_sum"], full_sum[rank * n:(rank + 1) * n])
        assert torch.allclose(res["reduce_scatter_avg"], full_sum[rank * n:(rank + 1) * n] / world_size)
        assert torch.allclose(res["all_reduce_avg"], torch.full((n,), total / world_size))
        assert res["all_reduce_max"].item() == world_size - 1
        assert torch.equal(res["broadcast"], torch.full((n,), float(world_size - 1)))
        # ZeRO-paper accounting: AG and RS count the full tensor, AR twice the tensor, broadcast once
        assert res["counter"]["bytes"] == {
            "all_gather": 4 * n * world_size,
            "reduce_scatter": 2 * 4 * n * world_size,
            "all_reduce": 2 * 4 * n + 2 * 4,
            "broadcast": 4 * n,
        }
        assert res["counter"]["calls"]["reduce_scatter"] == 2
