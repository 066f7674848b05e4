"""``LoadPlan``: everything one rank read and checked from a checkpoint, before anything in the job changes.

Every reading format (``format_protocol.CheckpointFormat.read``) returns one; ``save_load`` agrees across
the ranks that every rank has its plan, then puts it into the job's objects. A part a format's folder does
not hold is None (or a None entry): that object keeps its state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class LoadPlan:
    """One rank's checked state of a checkpoint, in the order of the job's prepared objects."""

    #: the job's optimizer step after the load
    step: int
    #: this rank's rows of each model's state dict (None: a model the checkpoint does not hold keeps its weights)
    models: list[dict[str, torch.Tensor] | None]
    #: each optimizer's state dict for this rank (None: kept)
    optimizers: list[dict[str, Any] | None]
    #: micro-steps done in the accumulation window at the save
    micro_step: int = 0
    #: each LR scheduler's state dict (None: the checkpoint holds none; the schedulers keep theirs)
    schedulers: list[Any] | None = None
    #: each data loader's position (None, or a None entry: that loader keeps its own)
    data: list[Any] | None = None
    #: the fp16 grad scaler's state dict (None: kept)
    scaler: dict[str, Any] | None = None
    #: the registered custom objects' state dicts (empty: none saved)
    custom: list[Any] = dataclasses.field(default_factory=list)
    #: this rank's RNG states (``job_files.rng_state``'s layout; None: kept)
    rng: dict[str, Any] | None = None
