"""A training script that saves asynchronously under a 20 s timeout, for the frozen-rank restart test.

    xshard launch --nproc 2 --max_restarts 1 restart_async_frozen_train.py OUT_DIR [FREEZE_AT_STEP]

The loop of ``restarts.train_losing_a_rank`` (no load_state: a restarted job resumes by itself), each
checkpoint saved with ``async_save=True`` under ``Accelerator(timeout=20)``. With FREEZE_AT_STEP, rank 1
of the first attempt stops itself (SIGSTOP) inside the background write of that step's checkpoint: the
other rank must fail within the timeout, the launcher restart the job, and the job end at the
uninterrupted run's weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

from restarts import freeze_during_background_write, train_losing_a_rank

import xshard

TOTAL_STEPS, SAVE_EVERY, GLOBAL_BATCH, TIMEOUT = 9, 3, 4, 20


def main(out: Path, freeze_at: int | None) -> None:
    acc = xshard.Accelerator(config={"stage": 3}, seed=0, timeout=TIMEOUT)
    if freeze_at is not None:
        freeze_during_background_write(acc, freeze_at)
    train_losing_a_rank(acc, out, None, TOTAL_STEPS, SAVE_EVERY, GLOBAL_BATCH // acc.world_size,
                        save=lambda: acc.save_state(out / f"checkpoint-{acc.step}", async_save=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
