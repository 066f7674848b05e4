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

from restarts import train_losing_a_rank

from xshard import Accelerator, ProjectConfiguration

#: 40 samples in per-rank batches of 2 on 2 ranks: 10 steps an epoch, so saves fall mid-epoch
TOTAL_STEPS, SAVE_EVERY, PER_RANK_BATCH, TOTAL_LIMIT = 16, 3, 2, 3


def main(out: Path, kill_at: int | None) -> None:
    project = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True, total_limit=TOTAL_LIMIT)
    acc = Accelerator(config={"stage": 3}, seed=0, project_config=project, timeout=60)

    def save() -> None:
        saved = acc.save_state()
        if acc.is_main_process:
            with open(out / "saved.txt", "a") as f:
                f.write(f"{saved.name}\n")

    train_losing_a_rank(acc, out, kill_at, TOTAL_STEPS, SAVE_EVERY, PER_RANK_BATCH, save)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
