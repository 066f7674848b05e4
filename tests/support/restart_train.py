"""A training script that knows nothing of restarts (no load_state call), for the --max_restarts test.

    xshard launch --nproc 2 --max_restarts 1 restart_train.py OUT_DIR [KILL_AT_STEP]

Trains to ``TOTAL_STEPS`` optimizer steps (the loop reads its position from ``accelerator.step``),
saving ``OUT_DIR/checkpoint-<step>`` every ``SAVE_EVERY`` steps; rank 0 finally writes the full
weights to ``OUT_DIR/final.pt``. With KILL_AT_STEP, rank 1 of the first attempt kills itself
(SIGKILL) right after that step, as a lost rank would die. The loop goes on over the loader across its
checkpoints, as users write it (a resumed run continues the epoch where the checkpoint left it), and
the model has dropout: the resumed run must still end at the uninterrupted run's weights, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from restarts import lose_rank
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xshard

TOTAL_STEPS, SAVE_EVERY, GLOBAL_BATCH = 12, 3, 4


def main(out: Path, kill_at: int | None) -> None:
    torch.set_num_threads(1)
    acc = xshard.Accelerator(config={"stage": 3}, seed=0, timeout=60)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 8, generator=g)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = DataLoader(TensorDataset(x, x.sum(-1).sin()), batch_size=GLOBAL_BATCH // acc.world_size, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    while acc.step < TOTAL_STEPS:
        for xb, yb in loader:
            acc.backward(nn.functional.mse_loss(model(xb).squeeze(-1), yb))
            opt.step()
            sched.step()
            opt.zero_grad()
            lose_rank(acc, kill_at)
            if acc.step % SAVE_EVERY == 0:
                acc.save_state(out / f"checkpoint-{acc.step}")
            if acc.step >= TOTAL_STEPS:
                break
    weights = acc.get_state_dict(model)
    if acc.is_main_process:
        torch.save(weights, out / "final.pt")
    acc.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
