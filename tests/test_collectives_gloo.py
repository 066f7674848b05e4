"""Real collectives on gloo, world sizes 2 and 4: values, uneven sizes, async handles, byte counts."""

from __future__ import annotations

import pytest
import torch
from support.collective_checks import assert_collective_results
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
    for rank, res in enumerate(results):
        assert_collective_results(res, rank, world_size, numel)
