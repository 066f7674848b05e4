"""The Trainer's ``checkpoint-N`` folders, holding xshard's portable state.

A ``checkpoint-N`` folder is first written whole and atomically by ``xshard.checkpoint.save_state``: the
model (``model.safetensors`` by default, which ``from_pretrained`` and ``xshard consolidate`` read), the
optimizer state by rows (so it resumes on another world size or stage), the Trainer's LR scheduler, the
fp16 grad scaler, the RNG states and the step, with the manifest ``xshard_state.json``. The Trainer then adds
its own files beside them: the tokenizer, ``training_args.bin``, ``rng_state_<rank>.pth`` and, last,
``trainer_state.json``. A checkpoint counts as complete when it has both the manifest and
``trainer_state.json``, so a save that a crash interrupted is never resumed from.

Data loaders are not part of it: the Trainer positions its training loader from ``trainer_state.json``'s
``global_step`` (and its evaluation loaders are new at each evaluation).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Any

from xshard.checkpoint import load_state, save_state
from xshard.checkpoint.consolidate import consolidated_state_dict
from xshard.checkpoint.files import MANIFEST, read_manifest
from xshard.job import JobState

__all__ = ["TRAINER_STATE", "latest", "load_job_state", "load_model_weights", "save_job_state"]

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


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
    if not (root / MANIFEST).is_file():
        raise ValueError(f"{root} is not a checkpoint written by xshard's Trainer (no {MANIFEST}): resume from a "
                         "checkpoint-N folder this Trainer saved")
    with_optimizer = int(read_manifest(root).get("optimizers", 0)) > 0
    view = _view(job, scheduler, with_optimizer)
    load_state(view, root)
    job.step, job.micro_step = view.step, view.micro_step


def load_model_weights(model: Any, folder: str | os.PathLike[str]) -> None:
    """Load only the model weights of the checkpoint in ``folder`` into the prepared ``model`` (each rank
    keeps its rows); used for ``load_best_model_at_end``."""
    model.load_full_state_dict(consolidated_state_dict(folder))


def is_complete(folder: Path) -> bool:
    """A checkpoint with xshard's manifest and the Trainer's state."""
    return (folder / MANIFEST).is_file() and (folder / TRAINER_STATE).is_file()


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
