"""What the ``--max_restarts`` tests share: a rank lost mid-run, the loop that loses it, and the job.

Two sides, one module: a training script in ``support/`` trains with ``train_losing_a_rank`` (which calls
``lose_rank(acc, kill_at)`` after each optimizer step; imported as ``from restarts import ...``: the
script's folder is first on its ``sys.path``), and the test starts that script with ``run_job``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
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


def freeze_during_background_write(acc: Any, at_step: int) -> None:
    """In the job's first attempt, rank ``LOST_RANK`` stops itself (SIGSTOP, as a hung node or a debugger
    would hold it) in the background write of the checkpoint of step ``at_step``, after its first file."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not (first_attempt and acc.process_index == LOST_RANK):
        return
    from xshard.checkpoint import async_save

    class Freezing(async_save.FileWriter):  # type: ignore[misc, valid-type]
        def _write(self, name: str, write: Callable[..., object]) -> None:
            super()._write(name, write)
            if self.folder.name.startswith(f"checkpoint-{at_step}."):
                os.kill(os.getpid(), signal.SIGSTOP)

    async_save.FileWriter = Freezing  # type: ignore[misc]


def train_losing_a_rank(acc: Any, out: Path, kill_at: int | None, total_steps: int, save_every: int,
                        per_rank_batch: int, save: Callable[[], None]) -> None:
    """The loop a user writes, on a tiny regression net with dropout: epoch after epoch over a plain
    ``shuffle=True`` loader (never leaving it at a checkpoint), ``save()`` every ``save_every`` optimizer
    steps, the position read from the restored state (``while acc.step < total_steps``; a restarted job
    resumes by itself). Rank ``LOST_RANK`` of the first attempt dies after step ``kill_at``; rank 0 finally
    writes the full weights to ``out/final.pt`` (the resumed run must equal the uninterrupted one's)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(7))
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = DataLoader(TensorDataset(x, x.sum(-1).sin()), batch_size=per_rank_batch, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    while acc.step < total_steps:
        for xb, yb in loader:
            acc.backward(nn.functional.mse_loss(model(xb).squeeze(-1), yb))
            opt.step()
            sched.step()
            opt.zero_grad()
            lose_rank(acc, kill_at)
            if acc.step % save_every == 0:
                save()
            if acc.step >= total_steps:
                break
    weights = acc.get_state_dict(model)
    if acc.is_main_process:
        torch.save(weights, out / "final.pt")
    acc.end()


def run_job(script: Path, out: Path, command: list[str], extra_env: dict[str, str] | None = None,
            kill_at: int | None = 7, script_args: list[str] | None = None) -> subprocess.CompletedProcess:
    """``command script out [kill_at]`` on the CPU backend, ``out`` created first; rank ``LOST_RANK`` of
    the first attempt kills itself after step ``kill_at`` (None: an uninterrupted run); ``script_args`` come
    after ``out``. A hang fails with every process's stacks (``support.jobs``)."""
    from support.jobs import run_job as run_reporting_hangs  # test side only: scripts import lose_rank

    out.mkdir()
    env = {**os.environ, "XSHARD_BACKEND": "cpu", **(extra_env or {})}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return run_reporting_hangs([*command, str(script), str(out), *(script_args or [])]
                               + ([str(kill_at)] if kill_at else []),
                               env=env, timeout=270)
