"""The output folder is one job's: a lock file held by the job that saves checkpoints there.

Two jobs saving numbered checkpoints into one folder rotate each other's checkpoints away. So the
main process takes ``<output folder>/.xshard_job.lock`` at the job's first save of a numbered
checkpoint there (``checkpoint-500``, Accelerate's ``checkpoint_3``, the Trainer's ``checkpoint-N``),
before anything is written, and removes it at the end of the job (``Accelerator.end()``, or when the
process exits). The file holds the owner's host, pid, the process's start time and job ids (JSON). A second
job's first save there is refused with one line naming the folder, the owner and the fix.

A lock whose owner is gone is taken over, with a warning naming it: on the same host, when its pid is
no longer running, or runs a process that started at another time than the lock's owner (the pid was reused
by an unrelated process: the start time comes from the process table, ``/proc/<pid>/stat``); from another host, when its owner has
not saved for ``OTHER_HOST_STALE_S`` (each save refreshes the file's time, so a long job that saves
keeps it). The same job restarted takes its lock back silently: ``xshard launch --max_restarts``
(torchrun's ``TORCHELASTIC_RUN_ID``, the same in every attempt of one launch) or a Slurm requeue
(``SLURM_JOB_ID`` and ``SLURM_STEP_ID``), on any host.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing.util
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from .files import CheckpointSaveError

__all__ = ["LOCK", "OTHER_HOST_STALE_S", "OutputFolderInUseError", "refusal", "release", "release_all", "take"]

LOCK = ".xshard_job.lock"
#: a lock from another host whose owner has not saved for this long (seconds: 24 h) is stale
OTHER_HOST_STALE_S = 24 * 3600
#: what names one job across its restarts: torchrun's elastic agent gives every attempt of one launch the same
#: run id (xshard launch: a fresh uuid per launch); Slurm keeps a requeued job's id and step
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"

#: folder (resolved) -> the text of the lock this process wrote there
_held: dict[Path, str] = {}


class OutputFolderInUseError(CheckpointSaveError):
    """Another job, still running, saves checkpoints into the same output folder."""


def _job_ids() -> dict[str, str | None]:
    """This job's ids (None where unset; torchrun's default run id "none" names no job)."""
    run_id = os.environ.get(RUN_ID_ENV, "")
    slurm = os.environ.get("SLURM_JOB_ID", "")
    return {"run_id": run_id if run_id and run_id != "none" else None,
            "slurm_job": f"{slurm}.{os.environ.get('SLURM_STEP_ID', '')}" if slurm else None}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    except (OSError, OverflowError):
        return False
    return True


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since the boot, from the process table), or None where it cannot
    be read (no such process, no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, after the command name in parentheses
    except (OSError, ValueError, IndexError):
        return None


def _describe(owner: dict[str, Any]) -> str:
    return f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}"


def _stale(owner: dict[str, Any] | None, path: Path) -> str | None:
    """Why the lock at ``path`` no longer holds (its owner is gone, or it is this job's), or None."""
    if owner is None:
        return "it cannot be read (a crash while it was written)"
    same_job = any(value is not None and owner.get(key) == value for key, value in _job_ids().items())
    pid = owner.get("pid")
    if owner.get("host") == socket.gethostname():  # a running process holds it, whatever its job ids say
        if pid == os.getpid():
            return ""
        if isinstance(pid, int) and _pid_running(pid):
            started = owner.get("process_start")
            if isinstance(started, int) and process_start(pid) not in (None, started):
                return (f"its process ({_describe(owner)}) is no longer running (pid {pid} now belongs to another "
                        "process, started later)")
            return None
        return "" if same_job else f"its process ({_describe(owner)}) is no longer running"
    if same_job:
        return ""  # this job's, from before a restart on another host: taken back without a word
    try:
        idle = time.time() - path.stat().st_mtime
    except OSError:
        return "it was removed"
    if idle > OTHER_HOST_STALE_S:
        return f"its owner ({_describe(owner)}) has not saved for {idle / 3600:.0f} h"
    return None


def refusal(folder: Path, owner: dict[str, Any] | None = None) -> str:
    """The one line that refuses a save into ``folder`` while another job holds it."""
    owner = owner if owner is not None else (_read(folder / LOCK) or {})
    return (f"cannot save a checkpoint in {folder}: another job saves checkpoints there ({_describe(owner)}, "
            f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(owner.get('started', 0)))}; "
            f"{folder / LOCK}); give this job another output folder, or remove that file if that job is gone")


def take(folder: Path) -> None:
    """Hold ``folder`` for this job (the main process, at a save); refreshes a lock already held.
    Raises ``OutputFolderInUseError`` when another running job holds it."""
    key = folder.resolve()
    path = folder / LOCK
    mine = _held.get(key)
    if mine is not None and _text(path) == mine:
        os.utime(path)
        return
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "process_start": process_start(os.getpid()),
                       "started": time.time(), **_job_ids()})
    for _ in range(3):
        if _create(path, text):
            if not _held:  # at the process's exit; a multiprocessing child runs no atexit, its finalizers
                atexit.register(release_all)
                multiprocessing.util.Finalize(None, release_all, exitpriority=0)
            _held[key] = text
            return
        owner = _read(path)
        why = _stale(owner, path)
        if why is None:
            raise OutputFolderInUseError(refusal(folder, owner))
        if why:
            warnings.warn(f"{path}: taking over the output folder's lock: {why}", stacklevel=4)
        path.unlink(missing_ok=True)
    raise OutputFolderInUseError(refusal(folder))  # another job took it each time: it is in use


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _create(path: Path, text: str) -> bool:
    """Write ``path`` whole, only if it does not exist (a hard link of a finished file: no reader ever
    sees it half written); False when it exists."""
    part = path.with_name(f"{LOCK}.{socket.gethostname()}.{os.getpid()}")
    part.write_text(text)
    try:
        os.link(part, path)
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links
        try:
            with open(path, "x", encoding="utf-8") as f:
                f.write(text)
        except FileExistsError:
            return False
    finally:
        part.unlink(missing_ok=True)
    return True


def release(folder: Path) -> None:
    """Remove the lock this process holds in ``folder`` (left alone if another job has taken it since)."""
    mine = _held.pop(folder.resolve(), None)
    if mine is not None and _text(folder / LOCK) == mine:
        (folder / LOCK).unlink(missing_ok=True)


def release_all() -> None:
    """The end of the job: every lock this process holds is removed."""
    for folder in list(_held):
        release(folder)
