"""Several XLA replicas on XLA:CPU, started by torch_xla's launcher: collectives and the step patch.

Each test starts a fresh process (see ``xla_replicas.run_replicas``) whose replicas are threads,
one per virtual CPU device; XLABackend numbers their collectives with channel ids so that the
separately compiled copies of each graph meet in the same collective.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")

import torch  # noqa: E402
from support.collective_checks import assert_collective_results  # noqa: E402
from support.xla_replicas import run_replicas  # noqa: E402

pytestmark = pytest.mark.xla


def _collectives(rank: int, world_size: int, numel: int, steps: int) -> dict:
    import torch_xla.debug.metrics as met

    from xshard.backends import get_backend

    backend = get_backend("xla")
    coll, d = backend.collectives, backend.device()
    out: dict = {"world": (backend.world.rank, backend.world.world_size)}
    compiles = []
    for _ in range(steps):
        shard = torch.arange(numel, dtype=torch.float32, device=d) + 1000 * rank
        gathered = torch.empty(numel * world_size, device=d)
        coll.all_gather_into_tensor(gathered, shard)
        full = torch.arange(numel * world_size, dtype=torch.float32, device=d) * (rank + 1)
        mine_sum = torch.empty(numel, device=d)
        coll.reduce_scatter_tensor(mine_sum, full.clone(), op="sum")
        mine_avg = torch.empty(numel, device=d)
        handle = coll.reduce_scatter_tensor(mine_avg, full.clone(), op="avg", async_op=True)
        t = torch.full((numel,), float(rank + 1), device=d)
        coll.all_reduce(t, op="avg")
        m = torch.tensor([float(rank)], device=d)
        coll.all_reduce(m, op="max")
        b = torch.full((numel,), float(rank), device=d)
        coll.broadcast(b, src=world_size - 1)
        backend.mark_step()
        coll.barrier()
        compiles.append(met.metric_data("CompileTime")[0])
    coll.barrier()  # the compile count is the process's: every replica reads its last before any goes on
    out.update(
        all_gather=gathered.cpu(), reduce_scatter_sum=mine_sum.cpu(), reduce_scatter_avg=handle.wait().cpu(),
        all_reduce_avg=t.cpu(), all_reduce_max=m.cpu(), broadcast=b.cpu(), compiles=compiles,
        counter=coll.counter.snapshot(),
    )
    return out


@pytest.mark.parametrize("world_size,numel", [(2, 5), (4, 3)])
def test_collectives_values_bytes_and_one_compile_per_graph(world_size: int, numel: int) -> None:
    steps = 3
    results = run_replicas(_collectives, world_size, numel, steps)
    for rank, res in enumerate(results):
        assert res["world"] == (rank, world_size)
        assert_collective_results(res, rank, world_size, numel, steps)  # the same as every other backend
        # channel numbering restarts with each graph: steps after the first compile nothing new
        assert res["compiles"][1] == res["compiles"][-1]


_spy_lock = threading.Lock()
_all_reduce_calls: dict[int, int] = {}


class _RefuseAllReduce(Exception):
    pass


def _spy_on_all_reduce() -> None:
    """Count xm.all_reduce calls per replica and refuse them (one would hang without channel ids)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    with _spy_lock:
        if getattr(xm.all_reduce, "_xshard_spy", False):
            return

        def spy(*args, **kwargs):
            rank = xr.global_ordinal()
            _all_reduce_calls[rank] = _all_reduce_calls.get(rank, 0) + 1
            raise _RefuseAllReduce

        spy._xshard_spy = True
        xm.all_reduce = spy


def _patched_optimizer_step(rank: int, world_size: int) -> dict:
    import torch_xla.core.xla_model as xm

    from xshard.backends import get_backend

    _spy_on_all_reduce()
    backend = get_backend("xla")
    d = backend.device()
    w = torch.nn.Parameter(torch.zeros(3, device=d))
    opt = torch.optim.SGD([w], lr=0.5)
    (w * (rank + 1)).sum().backward()
    original = xm.optimizer_step
    backend.collectives.barrier()  # every replica has seen the original before any patches it
    with backend.optimizer_step_patch():
        xm.optimizer_step(opt, barrier=True)
    backend.collectives.barrier()  # every replica has restored its patch
    calls_patched = _all_reduce_calls.get(rank, 0)
    restored = xm.optimizer_step is original
    try:  # the original reduces the gradients: the spy sees it (and refuses, instead of hanging)
        xm.optimizer_step(opt)
    except _RefuseAllReduce:
        pass
    return {"w": w.detach().cpu(), "calls_patched": calls_patched, "restored": restored,
            "calls_original": _all_reduce_calls.get(rank, 0) - calls_patched}


def test_patched_xm_optimizer_step_keeps_each_replicas_own_gradients() -> None:
    results = run_replicas(_patched_optimizer_step, 2)
    for rank, res in enumerate(results):
        assert res["calls_patched"] == 0
        assert torch.equal(res["w"], torch.full((3,), -0.5 * (rank + 1)))  # no averaging across replicas
        assert res["restored"]
        assert res["calls_original"] == 1
