"""The sharded core's communication buffers on 2 gloo ranks: gathered in place, reused across steps.

- stages 1-3: each parameter is gathered straight into its full copy's storage (padded to whole
  shards when dim 0 does not divide by the world size), and the values are the unsharded ones;
  at stage 2 the resident full copies keep their storage from step to step;
- stage 0: after the first step every gradient is a view of a persistent bucket buffer (no fresh
  bucket per step, no gradient outside the buckets, even while backward runs), the same buffers every
  step.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.models import batch, make_tiny

pytestmark = pytest.mark.multiprocess


def _storages(tensors) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in tensors]


def _run(rank: int, world: int) -> dict:
    from support.sharding_harness import init_backend

    from xshard.sharding import ShardingOptions, shard_model

    backend = init_backend()
    out: dict = {}
    held = []  # keeps step 0's buffers alive, so a fresh buffer could not reuse their addresses
    per = 8 // world
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model = make_tiny()
        reference = {name: p.detach().clone() for name, p in model.named_parameters()}
        sm = shard_model(model, backend, ShardingOptions(stage=stage))
        opt = torch.optim.SGD([p for p in sm.parameters() if p.requires_grad], lr=0.0)  # values stay put
        sm.register_optimizer(opt)
        if stage == 0:  # after the engine's own hook: how many gradients live outside the buckets
            outside = out.setdefault((0, "most_outside"), [0])

            def count_outside(_p: torch.nn.Parameter, sm=sm, outside=outside) -> None:
                buckets = set(_storages(b.flat for b in sm._engine.buckets if b.flat is not None))
                live = [q.grad for q in sm.parameters() if q.grad is not None]
                outside[0] = max(outside[0], sum(ptr not in buckets for ptr in _storages(live)))

            for p in sm.parameters():
                p.register_post_accumulate_grad_hook(count_outside)
        for step in range(3):
            if stage == 0 and step == 1:
                outside[0] = 0  # step 0 allocates the buckets: count from step 1
            ids, labels = batch(step, 8)
            loss = sm(ids[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per])
            if stage == 3 and step == 0:  # the root unit stays gathered until backward
                root = sm.units[0]
                out[(3, "root_in_place")] = all(
                    sp.gather_target.untyped_storage().data_ptr() == sp.full.untyped_storage().data_ptr()
                    and sp.full.untyped_storage().nbytes() == sp.layout.gather_numel * sp.full.element_size()
                    for sp in root.params)
                out[(3, "padded")] = any(sp.layout.gather_numel > sp.layout.numel for sp in root.params)
                names = {id(p): n for n, p in sm.module.named_parameters()}
                out[(3, "root_values")] = all(torch.equal(sp.full.detach(), reference[names[id(sp.user)]])
                                              for sp in root.params)
            loss.backward()
            if stage == 0:
                out[(0, step)] = _storages(p.grad for p in sm.parameters())
                out[(0, "buckets", step)] = _storages(b.flat for b in sm._engine.buckets)
                held += [b.flat for b in sm._engine.buckets]
            if stage == 2:
                out[(2, step)] = _storages(sp.full for u in sm.units for sp in u.params)
                held += [sp.full for u in sm.units for sp in u.params]
                out[(2, "values", step)] = all(
                    torch.equal(sp.full.detach(), reference[n])
                    for n, sp in ((n, sp) for u in sm.units for sp in u.params
                                  for n, p in sm.module.named_parameters() if p is sp.user))
            opt.step()
            opt.zero_grad(set_to_none=True)
    backend.destroy_process_group()
    return out


def test_buffers_gathered_in_place_and_reused() -> None:
    for res in run_workers(_run, 2):
        assert res[(3, "root_in_place")] and res[(3, "root_values")]
        assert res[(3, "padded")]  # the model has a parameter whose dim 0 does not divide by 2
        assert res[(2, 1)] == res[(2, 2)] == res[(2, 0)]
        assert all(res[(2, "values", s)] for s in range(3))
        # stage 0: the same bucket buffers every step, and from step 1 on every gradient lives in one
        assert res[(0, "buckets", 0)] == res[(0, "buckets", 1)] == res[(0, "buckets", 2)]
        assert res[(0, 1)] == res[(0, 2)]
        assert set(res[(0, 2)]) <= set(res[(0, "buckets", 2)])
        # zero_grad(set_to_none=True): each new gradient moves into its bucket as it arrives
        assert res[(0, "most_outside")] == [0]
