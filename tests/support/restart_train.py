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

from restarts import train_losing_a_rank

import xshard

TOTAL_STEPS, SAVE_EVERY, GLOBAL_BATCH = 12, 3, 4


def main(out: Path, kill_at: int | None) -> None:
    acc = xshard.Accelerator(config={"stage": 3}, seed=0, timeout=60)
    train_losing_a_rank(acc, out, kill_at, TOTAL_STEPS, SAVE_EVERY, GLOBAL_BATCH // acc.world_size,
                        save=lambda: acc.save_state(out / f"checkpoint-{acc.step}"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
