"""On the CPU, stage 3 keeps the memory of freed large layers for the next gather (xshard/sharding/storage_pool.py).

glibc's malloc hands freed blocks of 32 MiB and more back to the kernel, so without the pool every
gather of such a layer faults its memory in again, page by page. One process, layers of exactly
32 MiB (4096 x 2048 fp32), each its own unit.
"""

from __future__ import annotations

import resource
import sys

import pytest
import torch
from torch import nn

from xshard.sharding import ShardingOptions, shard_model
from xshard.sharding.storage_pool import MIN_POOLED_BYTES, can_pool

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not can_pool(),
                                reason="glibc's malloc and a torch that can move a storage's memory")

LAYER_BYTES = 4096 * 2048 * 4
PAGES_PER_LAYER = LAYER_BYTES // resource.getpagesize()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4096, 2048, bias=False), nn.Linear(2048, 4096, bias=False),
                         nn.Linear(4096, 2048, bias=False))


def _shard(cpu_backend, model: nn.Module, pool: bool = True):
    sm = shard_model(model, cpu_backend, ShardingOptions(stage=3, auto_wrap_policy="size",
                                                         min_num_params=4096 * 2048))
    if not pool:
        sm._rt.pool = None
    return sm


def _faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_second_forward_does_not_fault_its_large_layers_in_again(cpu_backend) -> None:
    assert LAYER_BYTES == MIN_POOLED_BYTES  # the smallest layer the pool keeps
    x = torch.randn(4, 4096)
    expected = _model()(x)
    with torch.no_grad():
        pooled = _shard(cpu_backend, _model())
        pooled(x)  # the first gathers fault the memory in once
        out = pooled(x)
        again = _faults(lambda: pooled(x))
        unpooled = _shard(cpu_backend, _model(), pool=False)
        unpooled(x)
        without = _faults(lambda: unpooled(x))
    torch.testing.assert_close(out, expected)
    assert again < PAGES_PER_LAYER // 4, again  # measured: 0
    assert without > 2 * PAGES_PER_LAYER, without  # what the pool saves: every layer, again (measured 24579: 3 x 8192 and 3)
    state = pooled.stats()["state_bytes"]
    assert state["unsharded_params"] == 0  # every layer freed after use...
    assert 0 < state["pooled"] <= 2 * LAYER_BYTES  # ...its memory kept: at most the unit in use and the next
    assert state["total"] == state["params"] + state["pooled"] + state["grads"] + state["optimizer"]
    assert state["device"] == state["total"]


def test_training_with_the_pool_gives_plain_pytorchs_weights(cpu_backend) -> None:
    plain, sharded_module = _model(), _model()
    sm = _shard(cpu_backend, sharded_module)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, sharded_module)]
    sm.register_optimizer(opts[1])
    for step in range(3):
        x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(step))
        for model, opt in ((plain, opts[0]), (sm, opts[1])):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert sm.stats()["state_bytes"]["pooled"] > 0
    with sm.summon_full_params():
        for ours, theirs in zip(sharded_module.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs)
