"""torch.compile on a prepared model, and on its blocks before prepare, at every stage on 2 gloo ranks.

Parity with plain eager PyTorch on the whole batch (AdamW with weight decay), and no recompilation
after the first two steps (the graphs see the same full-copy Parameters every step). aot_eager at every
stage; inductor (which really generates code) at stages 0 and 3, the two engines.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.distributed import run_workers
from support.semantics_cases import BATCH, Stack, _data

pytestmark = pytest.mark.multiprocess

STEPS = 4
RUNS = [(stage, "aot_eager", how) for stage in (0, 1, 2, 3) for how in ("model", "blocks")] + [
    (0, "inductor", "model"), (3, "inductor", "model")]


def _train(model, module, params, take) -> tuple[list[float], list[int]]:
    from torch._dynamo.utils import counters

    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if hasattr(module, "register_optimizer"):
        module.register_optimizer(opt)
    losses, graphs = [], []
    for step in range(STEPS):
        x, y = _data(step)
        loss = F.mse_loss(model(take(x)), take(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return losses, graphs


def _worker(rank: int, world: int) -> dict:
    from support.sharding_harness import init_backend

    from xshard.sharding import ShardingOptions, shard_model

    backend = init_backend()
    per = BATCH // world
    out = {}
    for stage, compiler, how in RUNS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Stack()
        if how == "blocks":  # the user compiles the blocks, then prepares the model
            for block in model.blocks:
                block.compile(backend=compiler)
        sm = shard_model(model, backend, ShardingOptions(stage=stage))
        run = torch.compile(sm, backend=compiler) if how == "model" else sm
        params = list(dict.fromkeys(sm.module.parameters()))
        out[(stage, compiler, how)] = _train(run, sm, params, lambda t: t[rank * per:(rank + 1) * per])
    backend.destroy_process_group()
    return out


def test_compiled_models_match_eager_pytorch_and_stop_compiling() -> None:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference.append(loss.item())
    results = run_workers(_worker, 2, timeout=270)
    for key in RUNS:
        losses = torch.tensor([r[key][0] for r in results]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(reference), atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
        for r in results:
            graphs = r[key][1]
            assert graphs[0] > 0, f"{key}: nothing was compiled"
            assert graphs[1] == graphs[2] == graphs[3], f"{key}: still compiling after warm-up: {graphs}"
