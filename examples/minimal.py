"""The smallest complete xshard training script: the same file runs on every backend.

    python examples/minimal.py                                   # one process
    torchrun --standalone --nproc_per_node 2 examples/minimal.py
    xshard launch --nproc 2 examples/minimal.py
    xshard launch --nproc 2 --config my_config.yaml examples/minimal.py
    XSHARD_BACKEND=cuda xshard launch examples/minimal.py        # all local GPUs

A small residual MLP learns a fixed random "teacher" function from synthetic data. The model,
optimizer, loader and scheduler are plain PyTorch; the Accelerator shards the model (ZeRO stage from
the config, 3 by default), shards the data over ranks, accumulates and clips as configured.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xshard


class Block(nn.Module):
    """One residual MLP block (the unit the sharded core gathers and frees)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyModel(nn.Module):
    """Input projection, ``depth`` blocks, a head; ``forward`` returns the MSE loss."""

    _no_split_modules = ["Block"]  # the "transformer" wrap policy makes each Block a unit

    def __init__(self, dim_in: int = 16, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.head(h).squeeze(-1).float(), y.float())


def synthetic_data(n: int, dim_in: int, seed: int = 1234) -> TensorDataset:
    """Inputs x ~ N(0, 1) and targets from a fixed random non-linear teacher (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim_in, generator=g)
    w1, w2 = torch.randn(dim_in, 32, generator=g), torch.randn(32, generator=g)
    y = torch.tanh(x @ w1 / dim_in**0.5) @ w2 / 32**0.5
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="xshard / DeepSpeed / accelerate config file")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="the same initial model and data order on every backend")
    args = parser.parse_args()

    acc = xshard.Accelerator(config=args.config, seed=args.seed)
    model = TinyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = synthetic_data(args.samples, 16)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    # A prepared scheduler steps once per process per optimizer step (as in Accelerate), so the schedule
    # is written in batches of one process, whatever the number of processes.
    steps = args.epochs * len(loader) // acc.gradient_accumulation_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(1, steps) + 1)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)

    acc.print(f"backend={acc.backend.name} world_size={acc.world_size} stage={acc.sharding_options().stage} "
              f"mixed_precision={acc.mixed_precision} accumulation={acc.gradient_accumulation_steps}")
    for epoch in range(args.epochs):
        total = torch.zeros((), device=acc.device)
        for batch in acc.progress(loader, desc=f"epoch {epoch}", leave=False):
            with acc.accumulate(model), acc.autocast():
                loss = model(*batch)
                acc.backward(loss)
                if acc.sync_gradients:  # clip the finished gradients, once per optimizer step
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.detach().float()
        mean = acc.reduce(total / len(loader), "mean")
        acc.print(f"epoch {epoch}: loss {mean.item():.4f}")
    acc.end()


if __name__ == "__main__":
    main()
