"""A user's Accelerate-style script with automatic checkpoint naming, for the restart naming test.

    xshard launch --nproc 2 --max_restarts 1 restart_naming_train.py OUT_DIR [KILL_AT_STEP]

``ProjectConfiguration(project_dir=OUT_DIR, automatic_checkpoint_naming=True, total_limit=3)``; the loop
goes over the data loader epoch after epoch, as users write it, and calls ``save_state()`` (no folder)
every ``SAVE_EVERY`` optimizer steps without leaving the loader. It reads its position from the
restored state (``while accelerator.step < TOTAL_STEPS``) and never calls ``load_state``: a restarted
job resumes by itself. The model has dropout: the restarted job must still end at the uninterrupted
job's weights, bit for bit. Rank 0 notes each folder ``save_state`` returned in ``OUT_DIR/saved.txt`` and
finally writes the full weights to ``OUT_DIR/final.pt``. With KILL_AT_STEP, rank 1 of the first
attempt kills itself right after that step (``restarts.lose_rank``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from restarts import lose_rank
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xshard import Accelerator, ProjectConfiguration

#: 40 samples in per-rank batches of 2 on 2 ranks: 10 steps an epoch, so saves fall mid-epoch
TOTAL_STEPS, SAVE_EVERY, PER_RANK_BATCH, TOTAL_LIMIT = 16, 3, 2, 3


def main(out: Path, kill_at: int | None) -> None:
    torch.set_num_threads(1)
    project = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True, total_limit=TOTAL_LIMIT)
    acc = Accelerator(config={"stage": 3}, seed=0, project_config=project, timeout=60)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 8, generator=g)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = DataLoader(TensorDataset(x, x.sum(-1).sin()), batch_size=PER_RANK_BATCH, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    while acc.step < TOTAL_STEPS:
        for xb, yb in loader:
            acc.backward(nn.functional.mse_loss(model(xb).squeeze(-1), yb))
            opt.step()
            sched.step()
            opt.zero_grad()
            lose_rank(acc, kill_at)
            if acc.step % SAVE_EVERY == 0:
                saved = acc.save_state()
                if acc.is_main_process:
                    with open(out / "saved.txt", "a") as f:
                        f.write(f"{saved.name}\n")
            if acc.step >= TOTAL_STEPS:
                break
    weights = acc.get_state_dict(model)
    if acc.is_main_process:
        torch.save(weights, out / "final.pt")
    acc.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
