"""The Trainer's ``checkpoint-N`` folders, holding xshard's portable state.

A ``checkpoint-N`` folder is first written whole and atomically by ``xshard.checkpoint.save_state``: the
model (``model.safetensors`` by default, which ``from_pretrained`` and ``xshard consolidate`` read), the
optimizer state by rows (so it resumes on another world size or stage), the Trainer's LR scheduler, the
fp16 grad scaler, the RNG states and the step, with the manifest ``xshard_state.json``. The Trainer then adds
its own files beside them: the tokenizer, ``training_args.bin``, ``rng_state_<rank>.pth`` and, last,
``trainer_state.json``. A checkpoint counts as complete when it has both the manifest and
``trainer_state.json``, so a save that a crash interrupted is never resumed from.

``save_total_limit`` is applied here (``rotate``), not by the stock Trainer's rotation, which counts a
symbolic link among its checkpoints (one linked in by hand can push out the checkpoint just saved).

Data loaders are not part of it: the Trainer positions its training loader from ``trainer_state.json``'s
``global_step`` (and its evaluation loaders are new at each evaluation).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from xshard.checkpoint import load_state, save_state
from xshard.checkpoint.consolidate import consolidated_state_dict
from xshard.checkpoint.files import MANIFEST, read_manifest
from xshard.checkpoint.trainer_folder import TRAINER_STATE, is_trainer_checkpoint
from xshard.runtime.job import JobState

__all__ = ["TRAINER_STATE", "latest", "load_job_state", "load_model_weights", "rotate", "save_job_state"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_DELETED = ".deleted"


def _view(job: JobState, scheduler: Any, with_optimizer: bool) -> JobState:
    """The part of the job a Trainer checkpoint holds: its models, its optimizers and the Trainer's LR
    scheduler (not with ``save_only_model``), the scaler, RNG and step; no data loaders."""
    return dataclasses.replace(
        job, optimizers=list(job.optimizers) if with_optimizer else [],
        schedulers=[scheduler] if with_optimizer and scheduler is not None else [],
        loaders=[], custom_objects=[],
    )


def save_job_state(job: JobState, folder: str | os.PathLike, scheduler: Any, with_optimizer: bool = True) -> Path:
    """Write xshard's state of the job into ``folder`` (every rank calls it); returns the path."""
    return save_state(_view(job, scheduler, with_optimizer), folder)


def load_job_state(job: JobState, folder: str | os.PathLike, scheduler: Any) -> None:
    """Restore what ``save_job_state`` wrote (on any world size and stage for the default ``full`` and
    ``sharded`` checkpoints); the optimizer and scheduler too when the checkpoint has them."""
    root = Path(folder)
    stock = not (root / MANIFEST).is_file() and is_trainer_checkpoint(root)  # the stock Trainer's (trainer_folder.py)
    if not (root / MANIFEST).is_file() and not stock:
        raise ValueError(f"{root} is not a checkpoint written by a Trainer (neither xshard's {MANIFEST} nor the stock "
                         f"Trainer's {TRAINER_STATE} with its model): resume from a checkpoint-N folder a Trainer saved")
    with_optimizer = (root / "optimizer.pt").is_file() if stock else int(read_manifest(root).get("optimizers", 0)) > 0
    view = _view(job, scheduler, with_optimizer)
    load_state(view, root)
    job.step, job.micro_step = view.step, view.micro_step


def load_model_weights(model: Any, folder: str | os.PathLike[str]) -> None:
    """Load only the model weights of the checkpoint in ``folder`` into the prepared ``model`` (each rank
    keeps its rows); used for ``load_best_model_at_end``."""
    model.load_full_state_dict(consolidated_state_dict(folder))


def is_complete(folder: Path) -> bool:
    """A checkpoint with xshard's manifest and the Trainer's state, or one the stock Trainer wrote whole."""
    return ((folder / MANIFEST).is_file() and (folder / TRAINER_STATE).is_file()) or is_trainer_checkpoint(folder)


def latest(output_dir: str | os.PathLike) -> Path | None:
    """The complete ``checkpoint-N`` with the highest N under ``output_dir`` (None if there is none); an
    incomplete one newer than it is named in a warning."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    numbered = sorted(((int(m.group(1)), p) for p in root.iterdir()
                       if p.is_dir() and (m := _CHECKPOINT.match(p.name))), reverse=True)
    for _, path in numbered:
        if is_complete(path):
            return path
        warnings.warn(f"skipping incomplete checkpoint {path} (its save did not finish)", stacklevel=2)
    return None


def rotate(output_dir: str | os.PathLike, keep: int, newest: str | os.PathLike,
           best: str | os.PathLike | None = None) -> list[Path]:
    """``save_total_limit``: delete the oldest ``checkpoint-N`` folders under ``output_dir`` (by N) so that
    ``keep`` remain; ``newest`` (the one just saved) and ``best`` (the best model's) are never deleted.

    A symbolic link named ``checkpoint-N`` is the user's (a checkpoint kept elsewhere): it is never counted,
    renamed or deleted through. A folder goes in two steps, renamed to ``checkpoint-N.deleted`` and then
    removed, so a crash in between never leaves a half-deleted checkpoint under its own name; one that
    vanished meanwhile (removed by hand, or by another job) is named in a warning. Returns what was deleted.
    """
    root = Path(output_dir)
    found = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _CHECKPOINT.match(p.name)) and p.is_dir() and not p.is_symlink())
    protected = {os.path.abspath(p) for p in (newest, best) if p is not None}
    ordered = [p for _, p in found]
    excess = len(ordered) - max(keep, sum(os.path.abspath(p) in protected for p in ordered))
    deleted = []
    for path in ordered:
        if excess <= 0:
            break
        if os.path.abspath(path) in protected:
            continue
        excess -= 1
        try:
            doomed = path.with_name(path.name + _DELETED)
            path.rename(doomed)
            shutil.rmtree(doomed)
        except FileNotFoundError as exc:
            warnings.warn(f"{path} vanished while save_total_limit deleted it ({exc.strerror}: {exc.filename}): "
                          f"something else deletes checkpoints in {root} (another job saving there, or by hand); "
                          "give each job its own output folder", stacklevel=2)
            continue
        deleted.append(path)
    for leftover in root.iterdir():  # a deletion that a crash interrupted
        if leftover.name.endswith(_DELETED) and _CHECKPOINT.match(leftover.name.removesuffix(_DELETED)) \
                and leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
    return deleted
