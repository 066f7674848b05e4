"""List-form collectives (one sharded unit's tensors as one operation) on real gloo ranks.

Every implementation is checked: the gloo options of the CPU backend (per tensor, in place:
broadcast into the outputs; one reduce per rank, an all-reduce, or a point-to-point exchange of the
inputs) and the default one
(pack into one buffer, one collective, unpack) that NCCL, HCCL and XLA use, and the gloo options' mix of
both (small tensors packed, large ones in place). Sizes are uneven and dtypes mixed; bytes and
calls follow the ZeRO-paper convention with one call per list.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

# elements per rank of each tensor: the third's piece is above PACK_BELOW_BYTES (moved on its own by the
# gloo options), the others below it (packed together, mixed dtypes)
SIZES = (3, 1, 20_000, 5)
DTYPES = (torch.float32, torch.bfloat16, torch.float32, torch.float32)


def _shard(i: int, rank: int) -> torch.Tensor:
    return (torch.arange(SIZES[i], dtype=torch.float32) + 100 * i + 10 * rank).to(DTYPES[i])


def _full_grad(i: int, rank: int, world_size: int) -> torch.Tensor:
    return torch.arange(SIZES[i] * world_size, dtype=torch.float32) * (rank + 1) + i


def _exercise(rank: int, world_size: int) -> dict:
    from xshard.backends import get_backend
    from xshard.backends.collectives import DistCollectives

    backend = get_backend("cpu")
    backend.init_process_group(timeout=60)
    out: dict = {}
    forms = {"gloo_options": backend.collectives, "packed": DistCollectives(),
             "via_all_reduce": DistCollectives(reduce_scatter_form="all_reduce"),
             "via_reduce": DistCollectives(reduce_scatter_form="reduce"),
             "via_exchange": DistCollectives(reduce_scatter_form="exchange")}
    for name, coll in forms.items():
        coll.counter.reset()
        # gather: tensor 0 in place (its input is its own output slice), the others from separate inputs
        outputs = [torch.full((n * world_size,), -1.0, dtype=d) for n, d in zip(SIZES, DTYPES, strict=True)]
        inputs = [_shard(i, rank) for i in range(len(SIZES))]
        own = outputs[0][rank * SIZES[0]:(rank + 1) * SIZES[0]]
        own.copy_(inputs[0])
        inputs[0] = own
        handle = coll.all_gather_into_tensors(outputs, inputs, async_op=True)
        handle.wait()
        out[(name, "gathered")] = outputs
        # reduce-scatter (one dtype): sum, avg, max
        for op in ("sum", "avg", "max"):
            grads = [_full_grad(i, rank, world_size) for i in range(len(SIZES))]
            shards = [torch.empty(n) for n in SIZES]
            coll.reduce_scatter_tensors(shards, grads, op=op)
            out[(name, op)] = shards
        # the output may be the input's own slice (an in-place reduce-scatter)
        grad = _full_grad(0, rank, world_size)
        coll.reduce_scatter_tensor(grad[rank * SIZES[0]:(rank + 1) * SIZES[0]], grad, op="sum")
        out[(name, "in place")] = grad[rank * SIZES[0]:(rank + 1) * SIZES[0]]
        out[(name, "counter")] = coll.counter.snapshot()
    backend.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_list_collectives_values_and_bytes(world_size: int) -> None:
    results = run_workers(_exercise, world_size)
    total = sum(r + 1 for r in range(world_size))
    for rank, res in enumerate(results):
        for name in ("gloo_options", "packed", "via_all_reduce", "via_reduce", "via_exchange"):
            for i, got in enumerate(res[(name, "gathered")]):
                expected = torch.cat([_shard(i, r) for r in range(world_size)])
                assert got.dtype == DTYPES[i] and torch.equal(got, expected), (name, i)
            for i, n in enumerate(SIZES):
                full_sum = torch.arange(n * world_size, dtype=torch.float32) * total + i * world_size
                mine = full_sum[rank * n:(rank + 1) * n]
                assert torch.allclose(res[(name, "sum")][i], mine), (name, i)
                assert torch.allclose(res[(name, "avg")][i], mine / world_size), (name, i)
                top = torch.arange(n * world_size, dtype=torch.float32) * world_size + i  # the last rank's
                assert torch.equal(res[(name, "max")][i], top[rank * n:(rank + 1) * n]), (name, i)
            n = SIZES[0]
            expected = (torch.arange(n * world_size, dtype=torch.float32) * total)[rank * n:(rank + 1) * n]
            assert torch.allclose(res[(name, "in place")], expected), name
            gather_bytes = sum(n * world_size * torch.empty((), dtype=d).element_size()
                               for n, d in zip(SIZES, DTYPES, strict=True))
            assert res[(name, "counter")] == {
                "bytes": {"all_gather": gather_bytes, "reduce_scatter": 4 * (3 * sum(SIZES) + SIZES[0]) * world_size},
                "calls": {"all_gather": 1, "reduce_scatter": 4},  # one call per list, whatever the wire does
            }, name


def test_list_collectives_single_process_and_errors() -> None:
    from xshard.backends.collectives import SingleProcessCollectives

    coll = SingleProcessCollectives()
    outputs, inputs = [torch.empty(2), torch.empty(3, dtype=torch.bfloat16)], [torch.ones(2), torch.full((3,), 2.0)]
    coll.all_gather_into_tensors(outputs, inputs)
    assert torch.equal(outputs[0], torch.ones(2)) and torch.equal(outputs[1], torch.full((3,), 2.0, dtype=torch.bfloat16))
    shards = [torch.empty(2)]
    assert coll.reduce_scatter_tensors(shards, [torch.tensor([3.0, 4.0])], async_op=True).wait()[0] is shards[0]
    assert torch.equal(shards[0], torch.tensor([3.0, 4.0]))
    assert coll.counter.snapshot()["calls"] == {"all_gather": 1, "reduce_scatter": 1}
    with pytest.raises(ValueError, match="2 outputs for 1 inputs"):
        coll.all_gather_into_tensors(outputs, inputs[:1])
    with pytest.raises(ValueError, match="share one dtype"):
        coll.reduce_scatter_tensors([torch.empty(1), torch.empty(1)],
                                    [torch.ones(1), torch.ones(1, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="not contiguous"):
        coll.all_gather_into_tensors([torch.empty(4, 2).t()], [torch.empty(8)])
