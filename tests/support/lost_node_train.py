"""A slow little training job for the lost-node tests, one rank per "node" (tests/support/netns.py).

    python lost_node_train.py OUT_DIR STEPS TIMEOUT

Trains a small net at stage 3 under ``Accelerator(timeout=TIMEOUT)`` for STEPS optimizer steps, a tenth
of a second apart (time for the test to cut the link mid-run), writing each step's number to
``OUT_DIR/step.rank<R>``; rank 0 finally writes the full weights to ``OUT_DIR/final.pt``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

import xshard


def main(out: Path, steps: int, timeout: float) -> None:
    torch.set_num_threads(1)
    acc = xshard.Accelerator(stage=3, seed=0, timeout=timeout)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    for step in range(1, steps + 1):
        xb = x[(step % 8) * 8:(step % 8) * 8 + 8]
        acc.backward(nn.functional.mse_loss(model(xb).squeeze(-1), xb.sum(-1).sin()))
        opt.step()
        opt.zero_grad()
        (out / f"step.rank{acc.process_index}").write_text(str(step))
        time.sleep(0.1)
    weights = acc.get_state_dict(model)
    if acc.is_main_process:
        torch.save(weights, out / "final.pt")
    acc.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
