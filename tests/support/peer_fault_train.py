"""A training job in which rank 1 fails after step 3, for the tests of how its peer names the fault.

    xshard launch --nproc 2 peer_fault_train.py OUT_DIR kill|raise|stall|usr1

Rank 1 lets rank 0 go ahead into step 4's collectives, then either dies (``kill``: SIGKILL, as the OOM
killer would), raises ``ValueError`` from its own code (``raise``) or stays in its own code (``stall``, with a
6 s timeout: until its flight records are written, which rank 0's hang asks for, then it exits with 3).
Rank 0's error (what the user sees from it) is written to ``OUT_DIR/rank0.txt`` as well as to its stderr.
``usr1``: no fault; after step 3 each rank sends itself SIGUSR1 (its flight records are written) and the job
ends normally.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import xshard


def main(out: Path, fault: str) -> None:
    torch.set_num_threads(1)
    acc = xshard.Accelerator(stage=3, seed=0, timeout=6 if fault == "stall" else 30)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    for step in range(1, 7):
        if step == 4 and acc.process_index == 1:
            time.sleep(1.0)  # rank 0 waits in step 4's first collective by now
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stall":
                mine = Path(os.environ["XSHARD_FLIGHT_DIR"]) / "rank1.json"
                deadline = time.monotonic() + 40
                while not mine.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                os._exit(3)
            if fault == "raise":
                raise ValueError("the labels of batch 4 hold NaN")
        if step == 4 and fault == "usr1":
            os.kill(os.getpid(), signal.SIGUSR1)
        try:
            acc.backward(nn.functional.mse_loss(model(x).squeeze(-1), x.sum(-1).sin()))
        except Exception as exc:
            (out / f"rank{acc.process_index}.txt").write_text(f"{type(exc).__name__}: {exc}")
            raise
        opt.step()
        opt.zero_grad()
    acc.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
