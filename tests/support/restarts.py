"""What the ``--max_restarts`` tests share: a rank lost mid-run, and the job that loses it.

Two sides, one module: a training script in ``support/`` calls ``lose_rank(acc, kill_at)`` after each
optimizer step (imported as ``from restarts import lose_rank``: the script's folder is first on its
``sys.path``), and the test starts that script with ``run_job``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

#: the rank that dies in a killed run
LOST_RANK = 1


def lose_rank(acc: Any, kill_at: int | None) -> None:
    """In the job's first attempt, rank ``LOST_RANK`` kills itself (SIGKILL, as a lost rank dies) once
    ``acc.step`` is ``kill_at``; a restarted attempt never does."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if kill_at is not None and kill_at == acc.step and first_attempt and acc.process_index == LOST_RANK:
        os.kill(os.getpid(), signal.SIGKILL)


def run_job(script: Path, out: Path, command: list[str], extra_env: dict[str, str] | None = None,
            kill_at: int | None = 7) -> subprocess.CompletedProcess:
    """``command script out [kill_at]`` on the CPU backend, ``out`` created first; rank ``LOST_RANK`` of
    the first attempt kills itself after step ``kill_at`` (None: an uninterrupted run). A hang fails
    with every process's stacks (``support.jobs``)."""
    from support.jobs import run_job as run_reporting_hangs  # test side only: scripts import lose_rank

    out.mkdir()
    env = {**os.environ, "XSHARD_BACKEND": "cpu", **(extra_env or {})}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return run_reporting_hangs([*command, str(script), str(out)] + ([str(kill_at)] if kill_at else []),
                               env=env, timeout=270)
