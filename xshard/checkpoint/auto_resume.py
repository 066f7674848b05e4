"""Automatic resume of a restarted job (`xshard launch --max_restarts N`): no change to the script.

torchrun's elastic agent restarts every rank of a job after one failed (``--max_restarts``), and
tells the new processes how many restarts happened (``TORCHELASTIC_RESTART_COUNT``). A restarted
process resumes from the newest complete checkpoint of its job, with the semantics of
``load_state(folder, resume_from_checkpoint=True, missing_ok=True)``: incomplete checkpoints are
skipped, a damaged newest one falls back to the one before, and no checkpoint at all starts from
scratch (logged).

Which folder: the one the job's earlier attempt saved into. `xshard launch` gives the ranks a small
file (``XSHARD_RESUME_FILE``) that outlives them; each ``save_state`` records its checkpoints' parent
folder there (``record``). Without that file (another launcher), a ``project_dir`` with automatic
checkpoint naming names it (``project_dir/checkpoints``).

When: once everything the checkpoint holds has been prepared (the counts of models, optimizers,
schedulers, data loaders and registered objects equal the manifest's), right after the
``prepare`` or ``register_for_checkpointing`` call that completed them, so the script's next line
already runs on the restored state. A loop that resumes exactly reads its position from that state
(``while accelerator.step < max_steps``, the data loaders' restored position).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..backends.launchers.torchrun import RESUME_FILE_ENV
from ..runtime.rank_logging import get_logger
from .files import MANIFEST, latest_checkpoint, read_manifest
from .save_load import resume

if TYPE_CHECKING:
    from ..runtime.job import JobState

__all__ = ["RESTART_ENV", "RESUME_FILE_ENV", "checkpoint_folder", "record", "restart_checkpoint", "restart_count"]

log = get_logger("xshard.checkpoint")

#: set by torchrun's elastic agent in every worker: 0 on the first start, N after the N-th restart
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted (0 on a first start, or under no elastic launcher)."""
    raw = (os.environ if env is None else env).get(RESTART_ENV, "0")
    return int(raw) if raw.strip().isdigit() else 0


def record(checkpoint: Path, local_rank: int, env: Mapping[str, str] | None = None) -> None:
    """Note that the job saves into ``checkpoint``'s parent folder (one process per node writes)."""
    target = (os.environ if env is None else env).get(RESUME_FILE_ENV)
    if not target or local_rank != 0:
        return
    folder = str(Path(checkpoint).resolve().parent)
    path = Path(target)
    try:
        if path.is_file() and path.read_text() == folder:
            return
        part = path.with_name(path.name + f".{os.getpid()}")
        part.write_text(folder)
        os.replace(part, path)
    except OSError as exc:  # never fail a save over this note; a restart then starts from scratch
        log.warning("could not note the checkpoint folder for a restart in %s: %s", target, exc)


def checkpoint_folder(project_dir: str | os.PathLike | None = None,
                      env: Mapping[str, str] | None = None) -> Path | None:
    """The folder a restarted job resumes from: the one its earlier attempt saved into, else
    ``project_dir/checkpoints``; None when neither is known."""
    target = (os.environ if env is None else env).get(RESUME_FILE_ENV)
    if target and Path(target).is_file():
        text = Path(target).read_text().strip()
        if text:
            return Path(text)
    if project_dir is not None and (Path(project_dir) / "checkpoints").is_dir():
        return Path(project_dir) / "checkpoints"
    return None


def restart_checkpoint(project_dir: str | os.PathLike | None = None,
                       env: Mapping[str, str] | None = None) -> Path | None:
    """The newest complete checkpoint a restarted job resumes from; None on a first start or when
    there is none (the job then starts from scratch)."""
    if restart_count(env) == 0:
        return None
    folder = checkpoint_folder(project_dir, env)
    return latest_checkpoint(folder) if folder is not None else None


def resume_if_restarted(job: JobState, project_dir: str | os.PathLike | None = None) -> Path | None:
    """After a restart, load the newest complete checkpoint once everything it holds is prepared.

    Called after each ``prepare`` and ``register_for_checkpointing``; acts at most once per job.
    Returns the folder loaded, or None.
    """
    if job.resumed_after_restart or restart_count() == 0:
        return None
    found = restart_checkpoint(project_dir)
    if found is None:
        job.resumed_after_restart = True
        log.warning("restart %d: no complete checkpoint of this job (%s): starting from scratch", restart_count(),
                    checkpoint_folder(project_dir) or f"no save_state yet, nor a project_dir; {RESUME_FILE_ENV} unset")
        return None
    if not _prepared_all(job, found):
        return None
    job.resumed_after_restart = True
    loaded = resume(job, found.parent, missing_ok=True)
    log.warning("restart %d: resumed automatically from %s (step %d)", restart_count(), loaded, job.step)
    return loaded


def _prepared_all(job: JobState, checkpoint: Path) -> bool:
    """Does the job hold as many prepared objects of each kind as the checkpoint saved?"""
    if not (checkpoint / MANIFEST).is_file():
        return True  # a foreign checkpoint: load it now; its own checks name what is missing
    manifest = read_manifest(checkpoint)
    custom = sum(1 for name in manifest.get("files", {}) if name.startswith("custom_checkpoint_"))
    have = (len(job.models), len(job.optimizers), len(job.schedulers), len(job.loaders), len(job.custom_objects))
    want = (manifest.get("models", 0), manifest.get("optimizers", 0), manifest.get("schedulers", 0),
            manifest.get("data_loaders", 0), custom)
    return have >= want
