"""``checkpoint-N`` folders written by the stock transformers Trainer, read into an xshard job.

So that a run started with the stock Trainer (on Accelerate's DDP, or one process) goes on under xshard from
its last checkpoint, on any world size and stage. The file names are the Trainer's (``Trainer._save_checkpoint``):

    model.safetensors                the model (``save_pretrained``); ``pytorch_model.bin`` with
                                     ``save_safetensors=False``; ``model.safetensors.index.json`` and its
                                     files for a model saved in several files
    optimizer.pt                     the optimizer's ``state_dict()`` (keyed by position)
    scheduler.pt, scaler.pt          torch.save of their state dicts
    rng_state_<rank>.pth             RNG states (read by the Trainer itself, ``_load_rng_state``)
    trainer_state.json               the step (``global_step``) and the log

Read by rows (``sources.py``), through the same key, shape and optimizer checks as xshard's own checkpoints.
The Trainer's checkpoint holds one model: a second prepared model (TRL's DPO reference model, which the stock
Trainer does not save) keeps its weights, and a log line says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.rank_logging import get_logger
from .files import CheckpointError
from .foreign import _full_optimizer, _state_dict, _torch_load
from .formats import optimizer_param_keys, read_model_rows, read_optimizer_rows
from .load_plan import LoadPlan
from .sources import DictSource, SafetensorsFilesSource, SafetensorsSource

if TYPE_CHECKING:
    from ..runtime.job import JobState

log = get_logger("xshard.checkpoint")

TRAINER_STATE = "trainer_state.json"
_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def is_trainer_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a ``checkpoint-N`` the stock Trainer wrote (its state last, so a complete one)."""
    return (folder.is_dir() and (folder / TRAINER_STATE).is_file()
            and any((folder / name).is_file() for name in (*_MODEL_FILES, "optimizer.pt")))


def _model_source(folder: Path) -> Any:
    if (folder / "model.safetensors").is_file():
        return SafetensorsSource(folder, folder / "model.safetensors")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({exc}); save the model again") from exc
        return SafetensorsFilesSource(folder, {key: folder / name for key, name in weight_map.items()})
    if (folder / "pytorch_model.bin").is_file():
        return DictSource(folder, _state_dict(folder / "pytorch_model.bin"), folder / "pytorch_model.bin")
    raise CheckpointError(f"{folder}: no model weights (expected one of {', '.join(_MODEL_FILES)}); resume from a "
                          "checkpoint-N folder the Trainer saved whole")


def read_plan(job: JobState, folder: Path) -> LoadPlan:
    """Everything this rank needs from a stock Trainer's ``checkpoint-N``, checked against the job; changes nothing."""
    models: list[dict[str, torch.Tensor] | None] = (
        [read_model_rows(_model_source(folder), job.models[0], "the model")] if job.models else [])
    if len(job.models) > 1:
        models += [None] * (len(job.models) - 1)
        log.info("%s holds one model (the stock Trainer's checkpoint): the %d other prepared model(s) keep their "
                 "weights", folder, len(job.models) - 1)
    optimizers: list[dict[str, Any] | None] = []
    for i, opt in enumerate(job.optimizers):
        path = folder / "optimizer.pt"
        if i > 0 or not path.is_file():
            raise CheckpointError(f"{folder}: no state of optimizer {i} (the stock Trainer writes one, optimizer.pt)")
        source, record = _full_optimizer(folder, path, _torch_load(path, mmap=True),
                                         optimizer_param_keys(opt.optimizer, job.models))
        optimizers.append(read_optimizer_rows(source, record, opt.optimizer, job.models, "the optimizer",
                                              job.rank, job.world_size))
    schedulers = []
    for _ in job.schedulers:
        if not (folder / "scheduler.pt").is_file():
            raise CheckpointError(f"{folder}: no state of the LR scheduler (expected scheduler.pt)")
        schedulers.append(_torch_load(folder / "scheduler.pt"))
    scaler = _torch_load(folder / "scaler.pt") if job.scaler is not None and (folder / "scaler.pt").is_file() else None
    try:
        step = int(json.loads((folder / TRAINER_STATE).read_text())["global_step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder / TRAINER_STATE} holds no global_step ({exc}); resume from a checkpoint-N "
                              "folder the Trainer saved whole") from exc
    log.info("reading the stock Trainer's checkpoint %s", folder)
    return LoadPlan(step=step, models=models, optimizers=optimizers, schedulers=schedulers, scaler=scaler)


class TrainerFolderFormat:
    """``checkpoint-N`` folders the stock transformers Trainer wrote: a ``format_protocol.ForeignFormat``."""

    name = "trainer"

    def recognises(self, folder: Path) -> bool:
        """Whether ``folder`` is a complete ``checkpoint-N`` of the stock Trainer."""
        return is_trainer_checkpoint(folder)

    def read(self, job: JobState, folder: Path, on_bytes: Callable[[int], None] | None = None) -> LoadPlan:
        """This rank's plan of the folder (``read_plan``; the bytes read are not counted)."""
        return read_plan(job, folder)


TRAINER_FOLDER = TrainerFolderFormat()
