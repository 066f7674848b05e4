"""A small xshard training job for the cluster-environment tests (started as real processes).

    python cluster_train.py OUT_DIR

It trains a three-block model at stage 3 for a few steps on rank-sharded data and writes, per rank,
``OUT_DIR/rank<R>.json`` with where the Accelerator placed it (rank, world size, local rank, the
environment it found) and, on rank 0, the final full weights (as lists of floats).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xshard


def main(out: Path) -> None:
    torch.set_num_threads(1)
    acc = xshard.Accelerator(config={"stage": 3}, seed=0, timeout=60)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, x.sum(-1).sin()), batch_size=16 // acc.world_size)
    model, opt, loader = acc.prepare(model, opt, loader)
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb).squeeze(-1), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    weights = acc.get_state_dict(model)
    world = acc.backend.world
    record = {"rank": world.rank, "world_size": world.world_size, "local_rank": world.local_rank,
              "local_world_size": world.local_world_size, "environment": world.environment,
              "weights": {k: v.tolist() for k, v in weights.items()}}
    (out / f"rank{world.rank}.json").write_text(json.dumps(record))
    acc.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
