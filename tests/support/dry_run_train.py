"""A user's training script for the dry-run tests: an MLP of four blocks, AdamW, a shuffled loader, checkpoints
on (``save_state`` at step 3, after the dry run's 2 steps have ended it).

    xshard launch --nproc 2 dry_run_train.py OUT [--stage S] [--shard_group_size G]
    xshard launch --dry-run --nproc 2 dry_run_train.py OUT [...]

A real run writes what it measured on each rank to ``OUT/rank<R>.json`` after step 2 (through the public
``model.stats()``): the units, the state this rank holds and the collectives of step 2, which the tests
compare with the dry run's report for the same world.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import xshard


class Block(torch.nn.Module):
    """One wrap unit: a linear layer and its activation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--shard_group_size", type=int, default=None)
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)

    options = {} if opts.shard_group_size is None else {"shard_group_size": opts.shard_group_size}
    acc = xshard.Accelerator(stage=opts.stage, seed=0, transformer_layer_cls_to_wrap=["Block"], **options)
    model = torch.nn.Sequential(torch.nn.Linear(16, 96), *[Block(96) for _ in range(4)], torch.nn.Linear(96, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 4))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    before_step_2 = None
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        if acc.step == 1:
            before_step_2 = model.stats()["comm"]
        if acc.step == 2:  # measured as the step ends, gradients still held
            stats = model.stats()
            step = {part: {kind: n - before_step_2[part].get(kind, 0) for kind, n in stats["comm"][part].items()
                           if n - before_step_2[part].get(kind, 0)} for part in ("calls", "bytes")}
            (out / f"rank{acc.process_index}.json").write_text(json.dumps({
                "units": stats["units"], "state_bytes": stats["state_bytes"], "collectives_per_step": step}))
        opt.zero_grad()
        if acc.step == 3:
            acc.save_state(str(out / "state"))
            break
    acc.end_training()


if __name__ == "__main__":
    main()
