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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .backends import Backend


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
        precision: the job's ``xshard.precision.Precision`` (autocast, backward, unscaling, the step);
            ``scaler`` is its fp16 grad scaler, or None.
        models, optimizers, schedulers, loaders: what ``prepare`` returned, in preparation order.
        step: real optimizer steps taken (saved in checkpoints).
        micro_step: micro-steps done in the current accumulation window.
        sync_gradients: True on micro-steps that end the window.
        clipped: the loop clipped the gradients in the current step.
        adjust_scheduler, sync_with_dataloader, sync_each_batch: Accelerate's accumulation
            settings (``xshard.utils.GradientAccumulationPlugin``).
        split_batches: a loader's batch size is the global batch (divided over the processes).
        step_scheduler_with_optimizer: prepared schedulers follow the optimizer (Accelerate's rule).
        custom_objects: objects registered for checkpointing (``state_dict``/``load_state_dict``).
    """

    backend: Backend
    config: Any
    device: torch.device
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    precision: Any = None
    models: list[Any] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)
    step: int = 0
    micro_step: int = 0
    sync_gradients: bool = True
    clipped: bool = False
    #: the background writer of async saves (``xshard.checkpoint.async_save``; keeps its host buffers), or None
    async_saver: Any = None
    #: a restarted job resumed (or found nothing to resume) already (``xshard.checkpoint.auto_resume``)
    resumed_after_restart: bool = False
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    split_batches: bool = False
    step_scheduler_with_optimizer: bool = True
    custom_objects: list[Any] = field(default_factory=list)

    @property
    def scaler(self) -> Any:
        """The fp16 grad scaler of the job's precision, or None (what checkpoints save and restore)."""
        return None if self.precision is None else self.precision.scaler

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
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 of each node."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.rank == self.world_size - 1

    @property
    def use_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    @property
    def timeout(self) -> float | None:
        """The job's timeout in seconds (its backend's: ``Accelerator(timeout=...)``, else the config's); None
        where the process group has torch's default."""
        return self.backend.timeout

    def barrier(self) -> None:
        """Every rank waits until all reach this point."""
        if self.world_size > 1:
            self.backend.collectives.barrier()

    # ------------------------------------------------------------------ the step
    def begin_micro_step(self, end_of_epoch: bool = False) -> bool:
        """Count one micro-step; returns (and records) whether it ends the accumulation window."""
        self.micro_step += 1
        self.sync_gradients = self.micro_step >= self.gradient_accumulation_steps or end_of_epoch
        if self.sync_gradients:
            self.micro_step = 0
        return self.sync_gradients

    def end_of_epoch(self) -> bool:
        """Is a prepared data loader handing out the last batch of its epoch (when that closes windows)?"""
        return self.sync_with_dataloader and any(loader.end_of_epoch for loader in self.loaders)

    def active_loader(self) -> Any:
        """The prepared data loader being iterated (the most recently started one), or None."""
        running = [loader for loader in self.loaders if loader.in_iteration]
        return max(running, key=lambda loader: loader.iteration_order) if running else None

    def finish_optimizer_step(self) -> None:
        """A prepared optimizer really stepped: count it and open a new step."""
        self.clipped = False
        self.step += 1

    def unscale_gradients(self) -> None:
        """Divide fp16 gradients by the loss scale, once per optimizer per step (before clipping)."""
        if self.scaler is not None:
            for optimizer in self.optimizers:
                optimizer.unscale()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip to a global norm over every rank's gradient shards; every rank returns the same norm.

        Prepared models compute one norm over all their gradients (the core knows which are shards);
        parameters of no prepared model are clipped as plain PyTorch does.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        self.unscale_gradients()
        norms = [m.clip_grad_norm_(max_norm, norm_type) for m in self.models
                 if any(id(p) in ids for p in m.parameters())]
        self.clipped = True
        if norms:
            return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def stage(self) -> int:
        """The ZeRO stage the config asks for."""
        return int(self.config.stage)
