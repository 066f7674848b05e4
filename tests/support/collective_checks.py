"""What every backend's collectives must give for the one exercise the collective tests run.

A worker gathers a shard of ``arange(numel) + 1000 * rank``, reduce-scatters (sum, then avg)
``arange(numel * W) * (rank + 1)``, all-reduces ``rank + 1`` (avg) and ``rank`` (max), broadcasts
``rank`` from the last rank, and returns the results under those names with its counter's
snapshot. ``assert_collective_results`` checks one rank's results and bytes (ZeRO-paper accounting)
after ``steps`` repetitions of it, on gloo (tests/test_collectives_gloo.py) as on XLA replicas
(tests/test_xla_replicas.py).
"""

from __future__ import annotations

import torch


def assert_collective_results(res: dict, rank: int, world_size: int, numel: int, steps: int = 1) -> None:
    """One rank's collective results and byte counts are what the exercise must give."""
    n = numel
    expected_gather = torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(world_size)])
    total = sum(r + 1 for r in range(world_size))
    full_sum = torch.arange(n * world_size, dtype=torch.float32) * total
    assert torch.equal(res["all_gather"], expected_gather)
    assert torch.allclose(res["reduce_scatter_sum"], full_sum[rank * n:(rank + 1) * n])
    assert torch.allclose(res["reduce_scatter_avg"], full_sum[rank * n:(rank + 1) * n] / world_size)
    assert torch.allclose(res["all_reduce_avg"], torch.full((n,), total / world_size))
    assert res["all_reduce_max"].item() == world_size - 1
    assert torch.equal(res["broadcast"], torch.full((n,), float(world_size - 1)))
    # ZeRO-paper accounting: AG and RS count the full tensor, AR twice the tensor, broadcast once
    assert res["counter"]["bytes"] == {
        "all_gather": steps * 4 * n * world_size,
        "reduce_scatter": steps * 2 * 4 * n * world_size,
        "all_reduce": steps * (2 * 4 * n + 2 * 4),
        "broadcast": steps * 4 * n,
    }
    assert res["counter"]["calls"]["reduce_scatter"] == 2 * steps
