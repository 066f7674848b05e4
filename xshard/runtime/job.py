"""JobState: where one training job runs, what it has prepared and where it stands in its steps.

The job's facts (rank, world size, local rank, the main-process flags, the device, the barrier) are
answered here and only here: the ``Accelerator`` and Accelerate's ``AcceleratorState`` view ask this
object, so no two places can disagree about which process this is.

The ``Accelerator`` owns one ``JobState``; the prepared optimizers and schedulers and the checkpoint
code receive it explicitly and read or update only what is written here, so none of them reaches
into the Accelerator (and nothing imports it back: the import graph has no circle).

Design note, the accumulation window: ``begin_micro_step`` decides at the start of each micro-step
whether it ends the window (the optimizer really steps, gradients are synchronised). The window
closes after ``gradient_accumulation_steps`` micro-steps, and always on the last batch of an epoch,
whose gradients would otherwise leak into the next epoch. Every decision depends only on counters
that are the same on every rank, so every rank synchronises at the same micro-step.

The counter is Accelerate's (its ``Accelerator.step``): micro-steps since a loader's last batch closed a
window, and a window ends where that count is a multiple of ``gradient_accumulation_steps``. Counting
from the window's own start would give the same flags while the number never changes; counting as
Accelerate does keeps them equal when a script changes it mid-run (``accelerator.gradient_accumulation_steps
= n``, as Accelerate's ``automatic_gradient_accumulation.py`` example does): the window then ends at the next
multiple of the new number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..backends import Backend
from ..config import XShardConfig
from .data import ShardedDataLoader
from .loader_job import LoaderAgreement, PassOrder
from .mixed_precision import Precision
from .throughput import ThroughputMeter

if TYPE_CHECKING:
    # the model's module imports torch._dynamo (about a second, and its cache folder): named for the type checker only
    from ..sharding import ShardedModel


class Stateful(Protocol):
    """What a checkpoint saves and restores of an object: a scheduler, a registered custom object."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class JobOptimizer(Stateful, Protocol):
    """A prepared optimizer as the job holds it (``xshard.runtime.prepared.PreparedOptimizer``, which
    imports this module: the Protocol keeps the two apart)."""

    optimizer: torch.optim.Optimizer
    #: the prepared model whose gradients it steps (clipped with the config's ``gradient_clipping``), or None
    model: ShardedModel | None

    @property
    def step_was_skipped(self) -> bool: ...


class BackgroundWrite(Protocol):
    """The job's async checkpoint writer (``xshard.checkpoint.async_save.AsyncSaver``) as the job holds it."""

    @property
    def pending(self) -> bool: ...

    def finish(self) -> tuple[Path | None, BaseException | None]: ...


@dataclass
class JobState:
    """Prepared objects, step counters and the accumulation window of one training job.

    Attributes:
        backend: the job's Backend (world, collectives, device hooks).
        config: the job's ``XShardConfig``.
        device: the device this process computes on (bound when the process group started).
        gradient_accumulation_steps: micro-steps per optimizer step.
        gradient_clipping: max global gradient norm applied at each step when the loop did not
            clip itself (0: none).
        precision: the job's ``xshard.runtime.mixed_precision.Precision`` (autocast, backward, unscaling, the step);
            ``scaler`` is its fp16 grad scaler, or None.
        models, optimizers, schedulers, loaders: what ``prepare`` returned, in preparation order.
        step: real optimizer steps taken (saved in checkpoints).
        accumulation_count: micro-steps since a loader's last batch closed a window (the design note);
            ``micro_step`` is the position in the current window it gives.
        sync_gradients: True on micro-steps that end the window.
        clipped: the loop clipped the gradients in the current step.
        adjust_scheduler, sync_with_dataloader, sync_each_batch: Accelerate's accumulation
            settings (``xshard.utils.GradientAccumulationPlugin``).
        split_batches: a loader's batch size is the global batch (divided over the processes).
        step_scheduler_with_optimizer: prepared schedulers follow the optimizer (Accelerate's rule).
        custom_objects: objects registered for checkpointing (``state_dict``/``load_state_dict``).
    """

    backend: Backend
    config: XShardConfig
    device: torch.device
    precision: Precision
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    models: list[ShardedModel] = field(default_factory=list)
    optimizers: list[JobOptimizer] = field(default_factory=list)
    schedulers: list[Stateful] = field(default_factory=list)
    loaders: list[ShardedDataLoader] = field(default_factory=list)
    step: int = 0
    accumulation_count: int = 0
    sync_gradients: bool = True
    clipped: bool = False
    #: the background writer of async saves (``xshard.checkpoint.async_save``; keeps its host buffers), or None
    async_saver: BackgroundWrite | None = None
    #: a restarted job resumed (or found nothing to resume) already (``xshard.checkpoint.auto_resume``)
    resumed_after_restart: bool = False
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    split_batches: bool = False
    step_scheduler_with_optimizer: bool = True
    custom_objects: list[Stateful] = field(default_factory=list)
    #: tokens, samples and time per optimizer step (``xshard.runtime.throughput``)
    throughput: ThroughputMeter = field(default_factory=ThroughputMeter)
    #: called with the job after each optimizer step (a dry run's report: ``xshard.runtime.dry_run_report``)
    step_observers: list[Callable[[JobState], None]] = field(default_factory=list)
    #: numbers the passes of this job's loaders (``active_loader`` asks it through their ``iteration_order``)
    loader_passes: PassOrder = field(default_factory=PassOrder)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 grad scaler of the job's precision, or None (what checkpoints save and restore)."""
        return self.precision.scaler

    # ------------------------------------------------------------------ the world (the job's facts)
    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.backend.world.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.backend.world.world_size

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self.backend.world.local_rank

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.backend.world.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 of each node."""
        return self.backend.world.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.backend.world.is_last_process

    @property
    def use_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.backend.world.use_distributed

    @property
    def timeout(self) -> float | None:
        """The job's timeout in seconds (its backend's: ``Accelerator(timeout=...)``, else the config's); None
        where the process group has torch's default."""
        return self.backend.timeout

    @property
    def loader_agreement(self) -> LoaderAgreement:
        """What the job's prepared loaders' ranks agree on (rank 0's shuffle state, every rank's batch counts),
        asked of the backend's collectives (``xshard.runtime.loader_job``)."""
        return LoaderAgreement(self.backend.collectives, self.device, self.world_size)

    def barrier(self) -> None:
        """Every rank waits until all reach this point."""
        if self.use_distributed:
            self.backend.collectives.barrier()

    # ------------------------------------------------------------------ the step
    @property
    def micro_step(self) -> int:
        """Micro-steps done in the current accumulation window (0 at a window's end; saved in checkpoints)."""
        return self.accumulation_count % self.gradient_accumulation_steps

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        # a restored position (a checkpoint's, the Trainer's reset) counts from a window's start
        self.accumulation_count = int(value)

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Change the micro-steps per optimizer step from the next micro-step on (the window ends at the next
        multiple of ``steps``, as in Accelerate); the config records the new number."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {steps!r}")
        self.gradient_accumulation_steps = steps
        self.config.gradient_accumulation_steps = steps

    def begin_micro_step(self, end_of_epoch: bool = False) -> bool:
        """Count one micro-step; returns (and records) whether it ends the accumulation window."""
        if end_of_epoch:  # the loader's last batch closes the window and restarts the count (Accelerate's rule)
            self.accumulation_count = 0
            self.sync_gradients = True
        else:
            self.accumulation_count += 1
            self.sync_gradients = self.accumulation_count % self.gradient_accumulation_steps == 0
        return self.sync_gradients

    def end_of_epoch(self) -> bool:
        """Is a prepared data loader handing out the last batch of its epoch (when that closes windows)?"""
        return self.sync_with_dataloader and any(loader.end_of_epoch for loader in self.loaders)

    def active_loader(self) -> ShardedDataLoader | None:
        """The prepared data loader being iterated (the most recently started one), or None."""
        running = [loader for loader in self.loaders if loader.in_iteration]
        return max(running, key=lambda loader: loader.iteration_order) if running else None

    def finish_optimizer_step(self) -> None:
        """A prepared optimizer really stepped: count it and open a new step."""
        self.clipped = False
        self.step += 1
        self.throughput.step_finished()
        for observer in self.step_observers:
            observer(self)

    def user_optimizers(self) -> list[torch.optim.Optimizer]:
        """The user's optimizers under the prepared ones (what the precision owner unscales and steps)."""
        return [prepared.optimizer for prepared in self.optimizers]

    def stage(self) -> int:
        """The ZeRO stage the config asks for."""
        return int(self.config.stage)
