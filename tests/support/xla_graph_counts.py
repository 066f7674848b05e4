"""How many XLA graphs a job compiles to start, to take one step and to save (run on each XLA:CPU replica).

``start_step_save`` runs the README's minimal example's model through ``Accelerator.prepare`` (model,
optimizer, loader, scheduler), one training step and ``save_state``, and reads torch_xla's
compilation count after each phase. The count is the process's: the replicas are threads of one
process and each compiles its own copy of a graph, so a graph counts once per replica. The
replicas meet at a host-side barrier (no graph of its own) before and after each reading.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def _compiles(world_size: int) -> int:
    """The process's compilation count, read by every replica between the same two barriers."""
    import torch_xla.debug.metrics as met

    from xshard.backends.collectives import replica_threads

    replica_threads.align(world_size)
    data = met.metric_data("CompileTime")
    replica_threads.align(world_size)
    return int(data[0]) if data else 0


def start_step_save(rank: int, world_size: int, outdir: str) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    import xshard

    sys.path.insert(0, str(ROOT / "examples"))
    import minimal

    before = _compiles(world_size)
    acc = xshard.Accelerator(backend="xla")  # unseeded: prepare broadcasts rank 0's weights
    model = minimal.TinyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(minimal.synthetic_data(64, 16), batch_size=8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    started = _compiles(world_size)
    x, y = next(iter(loader))
    acc.backward(model(x, y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    acc.backend.mark_step()
    stepped = _compiles(world_size)
    acc.save_state(outdir)
    saved = _compiles(world_size)
    return {"start": started - before, "step": stepped - started, "save": saved - stepped, "world": acc.world_size}
