"""One rank of the chaos test's training job (started by tests/test_checkpoint_chaos.py as a real process).

    python chaos_worker.py OUT_DIR    (with torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

Resumes from the newest complete checkpoint under OUT_DIR if there is one (``missing_ok=True``: the
first run has none), trains to ``TOTAL_STEPS`` optimizer steps with a checkpoint every
``SAVE_EVERY`` steps (``save_total_limit=2``), and rank 0 finally writes the full weights to
``OUT_DIR/final.pt``. Every rank prints ``EVENT <name> <step>`` lines (flushed) so that the driver
can kill a rank at a chosen moment: ``write`` before each file it writes into a checkpoint's ``.tmp``
folder, and rank 0 ``rotate_begin`` / ``remove`` / ``rotated`` as its rotation starts, before each deletion
and as it ends. ``XSHARD_CHAOS_HOLD="<name> <step>"``: once this rank has printed that event it stops there
(the driver kills it in that phase, for certain). The loop goes on over the loader across its checkpoints, as
users write it (a resumed run continues the epoch where the checkpoint left it), with dropout on: the
resumed and the uninterrupted runs must end bit for bit equal.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TOTAL_STEPS, SAVE_EVERY, GLOBAL_BATCH, N, DIM, WIDTH = 12, 3, 4, 40, 8, 96


#: "<name> <step>": the event after which this rank waits to be killed (the driver's aimed kills)
HOLD = os.environ.get("XSHARD_CHAOS_HOLD")


def event(name: str, step: int) -> None:
    print(f"EVENT {name} {step}", flush=True)
    if HOLD == f"{name} {step}":
        time.sleep(120)  # the driver kills this process here; a driver that does not is a hang it reports


class Net(nn.Module):
    _no_split_modules = ["Sequential"]  # each of the three blocks is one unit

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(3))
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + self.drop(block(h))
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def _report_phases(step: list[int]) -> None:
    """Print ``EVENT write <step>`` before each checkpoint file this rank writes, and (rank 0) ``EVENT
    rotate_begin <step>`` as save_total_limit's rotation starts, ``EVENT remove <step>`` before each folder it
    deletes and ``EVENT rotated <step>`` as it ends, so that the driver can kill a rank mid-save or mid-rotation
    and tell where its kill landed."""
    from xshard.checkpoint import files
    from xshard.checkpoint import save_load as state

    rotate, remove_folder, write = files.rotate, files.remove_folder, files.FileWriter._write

    def rotate_reporting(*args, **kwargs):
        event("rotate_begin", step[0])
        deleted = rotate(*args, **kwargs)
        event("rotated", step[0])
        return deleted

    def remove_reporting(path):
        event("remove", step[0])
        return remove_folder(path)

    def write_reporting(self, name, *args, **kwargs):
        event("write", step[0])
        return write(self, name, *args, **kwargs)

    state.rotate, files.remove_folder = rotate_reporting, remove_reporting
    files.FileWriter._write = write_reporting


def main(out: Path) -> None:
    import xshard

    torch.set_num_threads(1)
    acc = xshard.Accelerator(config={"stage": 3, "auto_wrap_policy": "none"}, seed=0, timeout=60)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, DIM, generator=g)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = DataLoader(TensorDataset(x, x.sum(-1).sin()), batch_size=GLOBAL_BATCH // acc.world_size, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    event("load_begin", 0)
    acc.load_state(out, resume_from_checkpoint=True, missing_ok=True)
    event("loaded", acc.step)
    step = [acc.step]
    _report_phases(step)
    while acc.step < TOTAL_STEPS:
        for xb, yb in loader:
            acc.backward(model(xb, yb))
            opt.step()
            sched.step()
            opt.zero_grad()
            event("step", acc.step)
            if acc.step % SAVE_EVERY == 0:
                event("save_begin", acc.step)
                step[0] = acc.step
                acc.save_state(out / f"checkpoint-{acc.step}", save_total_limit=2)
                event("saved", acc.step)
            if acc.step >= TOTAL_STEPS:
                break
    weights = model.full_state_dict()
    if acc.is_main_process:
        tmp = out / "final.pt.tmp"
        torch.save(weights, tmp)
        os.replace(tmp, out / "final.pt")
    event("done", acc.step)
    acc.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
