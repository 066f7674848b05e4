"""The user API: ``Accelerator`` turns a plain PyTorch training loop into a sharded one on any backend.

```python
acc = xshard.Accelerator(config="ds_config.json")   # or a dict / XShardConfig / None
model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
for batch in loader:
    with acc.accumulate(model), acc.autocast():
        loss = model(**batch).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
```

Design notes:
- Gradient accumulation is driven by ``config.gradient_accumulation_steps`` alone. ``accumulate``
  counts micro-steps; on the others it enters the model's ``no_sync`` (no communication), and the
  prepared optimizer's ``step``/``zero_grad`` and the scheduler's ``step`` do nothing, so the loop
  above needs no ``if``. The last batch of an epoch always closes the window (its gradients would
  otherwise leak into the next epoch). ``backward`` divides the loss by the number of steps.
- The scheduler steps once per real optimizer step (not once per process, and not when an fp16
  step was skipped for inf/nan gradients).
- Mixed precision needs nothing in the loop: ``prepare`` runs the model's forward under the
  backend's autocast in the config's mixed-precision dtype (fp32 inputs and tensors created inside
  the forward are cast to match; numerically sensitive ops such as softmax, norms and losses run in
  fp32) and returns floating outputs in fp32, as Accelerate does. ``autocast()`` enters the same
  autocast for work outside the model's forward (a loss computed from the outputs, a second
  model); with ``mixed_precision="no"`` it does nothing, so the loop above costs nothing in fp32.
- ``config.gradient_clipping`` > 0 clips inside ``optimizer.step()`` when the loop did not call
  ``clip_grad_norm_`` itself in that step.
- ``gather``/``reduce`` use the backend's collectives, whose byte counter the core's ``stats()``
  may share: call them outside the window you measure.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import sys
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader

from .accelerate_compat import tracking
from .accelerate_compat.accelerator_state import (
    AcceleratorState,
    GradientState,
    share_with_accelerate,
    unshare_with_accelerate,
)
from .accelerate_compat.accelerator_surface import AccelerateSurface
from .accelerate_compat.checkpoint_methods import CheckpointMethods
from .accelerate_compat.gathering import GatherMethods
from .backends import Backend, select
from .config.accelerate_args import AccelerateSettings, read_accelerate_args
from .config.accelerate_config import load_config, read_config_source, resolved_ds_config
from .runtime import grads
from .runtime.compile import compile_prepared
from .runtime.data import ShardedDataLoader, fork_may_deadlock, shard_data_loader
from .runtime.device_peak import DevicePeak
from .runtime.dry_run_report import DryRunReport
from .runtime.hub_kernels import turn_off_hub_kernels
from .runtime.job import JobState
from .runtime.launch_marker import mark_accelerator_built
from .runtime.mixed_precision import Precision
from .runtime.prepared import PreparedOptimizer, PreparedScheduler
from .runtime.rank_logging import get_logger, log_for_job, setup_logging
from .runtime.rebind import StaleParameterGuard, rebind_optimizer
from .runtime.throughput import ModelFlops, counting_hook

if TYPE_CHECKING:
    from .config import XShardConfig

log = get_logger("xshard.accelerator")

class Accelerator(AccelerateSurface, CheckpointMethods, GatherMethods):
    """One training job on one backend: process group, device, sharding, precision, accumulation.

    The checkpoint members (``save_state``, ``load_state`` ...) are ``accelerate_compat.checkpoint_methods``'s, the
    collectives (``gather``, ``reduce``, ``gather_for_metrics``) ``accelerate_compat.gathering``'s and Accelerate's
    other members ``accelerate_compat.accelerator_surface``'s: mixins built on the members this core declares
    (``accelerate_compat.accelerator_core``).

    Args:
        config: an xshard config file (or a DeepSpeed ``ds_config.json`` / accelerate FSDP yaml),
            a dict, an ``XShardConfig``, or None (defaults; ``XSHARD_CONFIG`` and ``XSHARD_*``
            environment variables apply in every case).
        backend: "auto" | "cpu" | "cuda" | "npu" | "mps" | "xla" or a registered backend's name; None follows
            ``XSHARD_BACKEND``.
        seed: seeds torch, the device, ``random`` and numpy on every rank (the same seed, so every
            rank builds the same initial model) and the data loaders' shuffles (default: the
            config's ``seed``). Without a seed nothing is seeded, the shuffle seed is 0, and
            ``prepare`` broadcasts rank 0's weights so that every rank starts from the same model.
        timeout: seconds (or a timedelta) a collective may wait for the other ranks before the job stops
            with a message naming the ranks that never arrived (default: the config's ``timeout``,
            30 minutes, ``XSHARD_TIMEOUT``).
        log_level / log_level_replica / log_on_each_node: see ``xshard.runtime.rank_logging``.
        **overrides: config fields, e.g. ``stage=2, gradient_accumulation_steps=4``, and Accelerate's
            constructor arguments (``mixed_precision``, ``gradient_accumulation_steps``, ``cpu``,
            ``split_batches``, ``dataloader_config``, ``step_scheduler_with_optimizer``,
            ``log_with``, ``project_dir``, ``project_config``, ``kwargs_handlers``,
            ``gradient_accumulation_plugin``, ``fsdp_plugin``, ``deepspeed_plugin``, ...), read as
            ``xshard.config.accelerate_args`` describes; the ones with no meaning here are named in one
            warning.
    """

    def __init__(
        self,
        config: Any = None,
        backend: str | None = None,
        *,
        seed: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        log_level: str | int | None = None,
        log_level_replica: str | int | None = None,
        log_on_each_node: bool | None = None,
        **overrides: Any,
    ) -> None:
        mark_accelerator_built()  # xshard launch: this job runs on xshard (whatever its settings say below)
        # Accelerate's arguments (the rest of **overrides are config fields); see accelerate_args
        compat = read_accelerate_args(overrides)
        overrides = {**compat.overrides, **overrides}
        source = read_config_source(config, compat)  # what kind of config it is: asked below, never guessed again
        backend = backend if backend is not None else compat.backend
        timeout = timeout if timeout is not None else compat.timeout
        self.config: XShardConfig = load_config(source, overrides, compat)
        config_backend = None if self.config.backend == "auto" else self.config.backend
        selection = select(backend if backend is not None else config_backend)
        # The backend knows where this process sits in the job (torchrun's variables, or torch_xla's
        # runtime under its own launcher).
        self.backend: Backend = selection.cls()
        world = self.backend.world
        setup_logging(world.rank, world.local_rank, world.world_size,
                      log_level if log_level is not None else self.config.log_level,  # file < env < argument
                      log_level_replica, log_on_each_node)
        self.backend.init_process_group(timeout=timeout if timeout is not None else self.config.timeout)
        #: the job's facts (rank, world size, device, barrier: the properties below ask it), prepared
        #: objects, step counters and the accumulation window (see ``xshard.runtime.job``)
        self._scaler_settings: dict[str, Any] = dict(compat.scaler_kwargs)  # GradScalerKwargs
        self.job: JobState = JobState(
            backend=self.backend, config=self.config, device=self.backend.device(),
            precision=self._choose_precision(self.config.mixed_precision),
            gradient_accumulation_steps=int(self.config.gradient_accumulation_steps),
            gradient_clipping=float(self.config.gradient_clipping or 0.0),
        )
        log.info("backend %s (%s) on %s, %d process(es)", self.backend.name, selection.reason, self.device,
                 world.world_size)
        dry_run = self.backend.dry_run()
        if dry_run is not None:  # xshard launch --dry-run: report after its steps (runtime/dry_run_report.py)
            from .checkpoint.save_load import planned_files

            self.job.step_observers.append(DryRunReport(self.job, dry_run, planned_files))

        chosen_seed = seed if seed is not None else self.config.seed
        #: None when nothing seeds the processes; then prepare() broadcasts rank 0's weights
        self.seeded: bool = chosen_seed is not None
        self.seed: int = int(chosen_seed) if chosen_seed is not None else 0  # also the data shuffle seed
        if self.seeded:
            self._seed_everything(self.seed)

        self._ended: bool = False
        self._token: str = uuid.uuid4().hex  # names this Accelerator when pickled (``__reduce__``)
        _LIVE[self._token] = self
        self._stale_guard: StaleParameterGuard = StaleParameterGuard()
        #: the device's peak FLOPS for the throughput report (found at the first report: a CPU measures it)
        self._peak: DevicePeak = DevicePeak(self.backend)
        #: Accelerate's arguments as read (``xshard.config.accelerate_args``), for the calls that read them later:
        #: the data seed, ``use_seedable_sampler`` and ``non_blocking`` (``prepare_data_loader``), ``dynamo``
        #: (``prepare_model``, ``state.dynamo_plugin``), ``autocast_enabled`` (``autocast``)
        self.accelerate_args: AccelerateSettings = compat
        self.profile_handler: Any = compat.profile_handler  # accelerator.profile()'s default ProfileKwargs
        #: Accelerate's ProjectConfiguration (project_dir, logging_dir, automatic checkpoint naming):
        #: xshard's or Accelerate's own class, read by its fields
        self.project_configuration: Any = compat.project
        #: the trackers ``log_with`` chose (``init_trackers`` starts them on the main process)
        self.tracker_choice: list[Any] = tracking.resolve(compat.log_with, self.logging_dir)
        #: the running trackers (main process; after ``init_trackers``)
        self.trackers: list[Any] = []
        #: Accelerate's ``AcceleratorState`` and ``GradientState``, read from this job
        #: (``xshard.accelerate_compat.accelerator_state``)
        self.state: AcceleratorState = AcceleratorState(
            self, "deepspeed" if source.configured_by_deepspeed else "xshard",
            resolved_ds_config(compat, dict(source.deepspeed) if source.deepspeed is not None else None))
        self.gradient_state: GradientState = GradientState(self.job)
        self._setup_accelerate(compat)

    # ------------------------------------------------------------------ facts (answered by the JobState)
    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.job.world_size

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self.job.local_rank

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self.job.device

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.job.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 of each node."""
        return self.job.is_local_main_process

    @property
    def sync_gradients(self) -> bool:
        """True on micro-steps that end an accumulation window (the optimizer really steps)."""
        return self.job.sync_gradients

    # ------------------------------------------------------------------ precision
    @property
    def mixed_precision(self) -> str:
        """The mixed precision of the job: "no", "bf16" or "fp16"."""
        return self.precision.name

    @mixed_precision.setter
    def mixed_precision(self, value: str) -> None:
        """Choose another mixed precision before the first model is prepared (e.g. "no" where
        ``supports`` says the device cannot compute in the one the config asks for)."""
        if self.job.models:
            raise ValueError("mixed_precision can only change before the first prepare(model): the prepared "
                             "model already computes in " + repr(self.precision.name))
        self.job.precision = self._choose_precision(value)

    def supports(self, precision: str | torch.dtype) -> bool:
        """Can this process's device compute in ``precision`` ("no", "bf16", "fp16" or a torch dtype)?

        Asked on the device this process is bound to (never by starting a runtime elsewhere).
        """
        return Precision.supported(self.backend, precision)

    def _choose_precision(self, value: Any) -> Precision:
        """The Precision ``value`` names, its name recorded in the config (one owner: see
        ``xshard.runtime.mixed_precision``)."""
        precision = Precision.choose(value, self.backend, self._scaler_settings)
        self.config.mixed_precision = precision.name
        return precision

    @property
    def precision(self) -> Precision:
        """The job's mixed precision: dtypes, autocast, backward, the fp16 scaler and the optimizer step
        (``xshard.runtime.mixed_precision``; the job holds it)."""
        return self.job.precision

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the forward computes in under autocast (None for "no")."""
        return self.precision.compute_dtype

    @property
    def pad_to_multiple_of(self) -> int | None:
        """The width token batches are padded to a multiple of, on backends that compile graphs (XLA:
        ``static_shape_multiple``, 64 by default); None elsewhere. Prepared data loaders apply it; pass it
        to your collator (e.g. ``DataCollatorWithPadding(pad_to_multiple_of=...)``) for loaders you
        do not prepare."""
        multiple = int(self.config.static_shape_multiple)
        return multiple if self.backend.compiles_graphs and multiple > 0 else None

    @property
    def step(self) -> int:
        """Real optimizer steps taken (saved in checkpoints; orders them for ``resume_from_checkpoint``)."""
        return self.job.step

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step (from the config; settable, as in Accelerate)."""
        return self.job.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self.job.set_gradient_accumulation_steps(steps)  # the window, backward's division, gradient_state follow

    @property
    def gradient_clipping(self) -> float:
        """Max global gradient norm applied at each step when the loop does not clip (0: none)."""
        return self.job.gradient_clipping

    @property
    def scaler(self) -> Any:
        """The fp16 grad scaler (None unless mixed_precision is fp16)."""
        return self.precision.scaler

    # ------------------------------------------------------------------ setup helpers
    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        try:
            import numpy as np

            np.random.seed(seed % 2**32)
        except ImportError:
            pass
        self.backend.manual_seed(seed)

    def sharded_init(self) -> contextlib.AbstractContextManager[Any]:
        """Build a model in code without holding it whole: ``with accelerator.sharded_init(): model =
        MyModel()``, then ``accelerator.prepare(model, ...)`` gives each rank its rows of the values a
        normal init gives (as DeepSpeed's ``zero.Init``; see ``xshard.sharding.sharded_init``).

        Inside the block the parameters are on the meta device; an optimizer may be built on them
        before ``prepare`` (it is rebound to the sharded parameters). A multi-process job takes rank
        0's values, rebuilt and broadcast one parameter at a time (``sync_module_states``, see
        ``XShardConfig.to_sharding_options``), so no rank ever holds the whole model.
        """
        from .sharding import sharded_init

        return sharded_init()

    def sharding_options(self, model: torch.nn.Module | None = None, *,
                         weights_from_checkpoint: bool | None = None) -> Any:
        """The core's ShardingOptions from this config, for this job (and ``model``): built by
        ``XShardConfig.to_sharding_options`` from the world size, the precision's output dtype (fp32
        under mixed precision, as Accelerate returns outputs) and whether the weights come from a
        checkpoint on every rank (``weights_from_checkpoint``; by default: ``model``'s parameters are on
        the meta device and not recorded by ``sharded_init``)."""
        from .sharding.sharded_init import recording_of

        to_load = weights_from_checkpoint
        if to_load is None:
            to_load = model is not None and recording_of(model) is None and any(p.is_meta for p in model.parameters())
        return self.config.to_sharding_options(world_size=self.world_size, output_dtype=self.precision.output_dtype,
                                               weights_from_checkpoint=to_load)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objs: Any) -> Any:
        """Prepare models, optimizers, data loaders and LR schedulers (any order, any number).

        Returns them in the order given (one object alone is returned as itself). Models are
        sharded (``shard_model``) and their original ``nn.Parameter`` objects hold this rank's
        shard, so an optimizer built before ``prepare`` keeps working.
        """
        out: list[Any] = list(objs)
        order: tuple[tuple[type, Callable[[Any], Any]], ...] = (
            (torch.nn.Module, self.prepare_model),
            (torch.optim.Optimizer, self.prepare_optimizer),
            (DataLoader, self.prepare_data_loader),
            (torch.optim.lr_scheduler.LRScheduler, self.prepare_scheduler),
        )
        for kind, prepare_one in order:  # models before optimizers before schedulers
            for i, obj in enumerate(objs):
                if isinstance(obj, kind) and not _is_prepared(obj):
                    out[i] = prepare_one(obj)
        for obj in objs:
            if not any(isinstance(obj, kind) for kind, _ in order) and not _is_prepared(obj):
                raise TypeError(
                    f"prepare() got a {type(obj).__name__}: it takes nn.Module, torch.optim.Optimizer, "
                    "torch.utils.data.DataLoader and torch.optim.lr_scheduler.LRScheduler objects"
                )
        for obj in out:
            if isinstance(obj, PreparedOptimizer) and self.job.models:
                _warn_outside_models(obj.optimizer, self.job.models)
        self._resume_if_restarted()
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Shard ``model`` over the job with the config's sharding options.

        Accelerate's ``device_placement`` and ``evaluation_mode`` are accepted (the transformers Trainer
        passes them for a model it only evaluates): the model is sharded and placed as for training,
        whose forward is the same.
        """
        if any(model is m for m in self.job.models):
            return model
        # imports torch._dynamo: at the first model, not at import
        from .sharding import ShardedModel, shard_model

        if not self.backend.runs_hub_kernels:
            turn_off_hub_kernels(model, self.backend.device_type)
        sharded = model if isinstance(model, ShardedModel) else shard_model(
            model, self.backend, self.sharding_options(model))
        self.job.models.append(sharded)
        flops = ModelFlops.of(sharded.module, sharded.full_numel)
        self.job.throughput.models.append(flops)
        sharded.register_forward_pre_hook(counting_hook(self.job.throughput, flops), with_kwargs=True)
        replaced = sharded.rebound_parameters
        if replaced:
            self._stale_guard.watch(list(replaced.old.values()))
        for opt in self.job.optimizers:  # an optimizer prepared before its model
            rebind_optimizer(opt.optimizer, replaced.new)
            if opt.model is None and _owns(sharded, opt.optimizer):
                opt.model = sharded
                sharded.register_optimizer(opt.optimizer)
        return compile_prepared(sharded, self.accelerate_args.dynamo)  # Accelerate's dynamo_plugin (runtime/compile.py)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap ``optimizer``: steps through the backend and the grad scaler, only on sync steps.

        An optimizer built before ``prepare`` whose Parameters had to be replaced on the device (XLA)
        is rebound to the replacements (see ``xshard.runtime.rebind``).
        """
        for m in self.job.models:
            rebind_optimizer(optimizer, m.rebound_parameters.new)
        model = next((m for m in self.job.models if _owns(m, optimizer)), None)
        if model is not None:
            model.register_optimizer(optimizer)
        prepared = PreparedOptimizer(optimizer, self.job, model)
        self.job.optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        """Wrap an LR scheduler so it steps as Accelerate's does (``xshard.runtime.prepared``)."""
        owners = [o for o in self.job.optimizers if o.optimizer is getattr(scheduler, "optimizer", None)]
        prepared = PreparedScheduler(scheduler, owners or list(self.job.optimizers), self.job)
        self.job.schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, loader: DataLoader, shard: bool = True) -> ShardedDataLoader:
        """Give ``loader`` this rank's slice of every epoch (``xshard.runtime.data``) and device placement.

        ``loader.batch_size`` is per process: the global batch is ``batch_size * world_size``
        (with ``split_batches=True`` it is the global batch, divided over the processes).
        """
        prepared = shard_data_loader(
            loader, self.device, num_replicas=self.world_size, rank=self.rank, seed=self._shuffle_seed(),
            wrap=self.backend.wrap_dataloader, shard=shard, split_batches=self.job.split_batches,
            non_blocking=self.accelerate_args.non_blocking, pad_to_multiple_of=self.pad_to_multiple_of,
            agreement=self.job.loader_agreement, pass_order=self.job.loader_passes,
        )
        self.job.loaders.append(prepared)
        self._fill_auto_batch(prepared)
        if fork_may_deadlock(loader):
            log.warning_once(
                "this interpreter (Python %s) can deadlock a DataLoader worker as it forks while the job's threads "
                "run (CPython gh-112275, fixed in 3.11.10 and 3.12): a worker then never starts and its rank "
                "waits; use Python >= 3.11.10, or DataLoader(multiprocessing_context='forkserver') with the "
                "script's code under `if __name__ == \"__main__\":`", sys.version.split()[0],
                main_process_only=True)
        return prepared

    def _shuffle_seed(self) -> int | None:
        """The seed of a plain ``shuffle=True`` as Accelerate seeds it (``xshard.runtime.batch_order``): with
        ``use_seedable_sampler``, ``data_seed`` or else ``torch.random.initial_seed()`` now (the script's
        ``set_seed``, before or after building the Accelerator); None for Accelerate's default order, drawn
        from torch's global RNG."""
        settings = self.accelerate_args
        if not settings.use_seedable_sampler:
            return None
        return settings.data_seed if settings.data_seed is not None else torch.random.initial_seed()

    # ------------------------------------------------------------------ the training step
    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients are synchronised only at the end of an accumulation window."""
        self.job.begin_micro_step(end_of_epoch=self.job.end_of_epoch())
        with contextlib.ExitStack() as stack:
            if not self.job.sync_gradients and not (self.job.sync_each_batch and self.world_size > 1):
                for model in models or self.job.models:
                    no_sync = getattr(model, "no_sync", None)
                    if no_sync is not None:
                        stack.enter_context(no_sync())
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided over the accumulation window and scaled for fp16."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self.precision.backward(loss, **kwargs)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        """The backend's autocast in the config's mixed-precision dtype (nothing for "no").

        ``autocast_handler``: an ``AutocastKwargs``; ``enabled=False`` turns it off in the block
        (default: the one given in ``kwargs_handlers``).
        """
        enabled = self.accelerate_args.autocast_enabled if autocast_handler is None else bool(autocast_handler.enabled)
        return self.precision.autocast(enabled)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip gradients to a global norm over all shards (every rank agrees); returns the norm.

        For a prepared model, the whole model's gradients are clipped (the core computes one norm).
        On micro-steps inside an accumulation window it does what Accelerate does: it clips the
        gradients this process accumulated so far (not yet reduced) and returns their local norm
        (``xshard.runtime.grads``); call it under ``if accelerator.sync_gradients:`` to clip only the
        finished gradients.
        """
        if self.job.sync_gradients:
            norm = self.precision.clip_grad_norm_(self.job.models, self.job.user_optimizers(), parameters, max_norm,
                                                  norm_type)
            self.job.clipped = True
            return norm
        return grads.clip_norm_(self._window_gradients(parameters), max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.nn.Parameter] | torch.Tensor, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (fp16: after unscaling).

        Exact at every stage (clamping a shard clamps those elements of the full gradient); inside
        an accumulation window it clamps the gradients accumulated so far, as Accelerate does.
        """
        if self.job.sync_gradients:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.precision.clip_grad_value_(self.job.user_optimizers(), [p.grad for p in params if p.grad is not None],
                                            clip_value)
        else:
            grads.clip_value_(self._window_gradients(parameters), clip_value)

    def _window_gradients(self, parameters: Iterable[torch.nn.Parameter] | torch.Tensor) -> list[torch.Tensor]:
        if self.scaler is not None:
            raise ValueError("clipping inside an accumulation window with mixed_precision='fp16' would clip "
                             "loss-scaled gradients: clip under `if accelerator.sync_gradients:`")
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        return grads.held_gradients(self.job.models, params)

    def throughput(self) -> dict[str, Any]:
        """This rank's training throughput since the last call (or the first optimizer step; the first step
        is warm-up and left out): ``tokens_per_second_per_device`` (non-padding tokens where the batch has an
        ``attention_mask``), ``samples_per_second`` (this rank's times the world size), ``tflops_per_device``
        and ``mfu`` against the device's peak (``peak_tflops``, ``peak_source``; ``XSHARD_PEAK_TFLOPS``
        overrides it), with the counts, the seconds and the FLOPs formula used (``xshard.runtime.throughput``).
        Reads the counted mask sums from the device: call it where the loop already synchronises (logging)."""
        return self.job.throughput.report(self.world_size, self._peak(self.compute_dtype))

    # ------------------------------------------------------------------ processes
    def wait_for_everyone(self) -> None:
        """Barrier: every rank waits until all reach this point."""
        self.job.barrier()

    # ------------------------------------------------------------------ Accelerate's arguments and state
    def _setup_accelerate(self, compat: AccelerateSettings) -> None:
        """Apply Accelerate's arguments to the job; name the ones with no meaning here in one warning."""
        job = self.job
        job.adjust_scheduler, job.sync_with_dataloader = compat.adjust_scheduler, compat.sync_with_dataloader
        job.sync_each_batch, job.split_batches = compat.sync_each_batch, compat.split_batches
        job.step_scheduler_with_optimizer = compat.step_scheduler_with_optimizer
        log_for_job(self.job)  # in_order logging takes turns in its ranks, at its barrier
        share_with_accelerate(self)  # accelerate.logging.get_logger works beside this Accelerator
        if compat.ignored and self.is_main_process:
            warnings.warn("Accelerator: these arguments have no effect in xshard and are ignored: "
                          + "; ".join(compat.ignored), stacklevel=3)

    def _fill_auto_batch(self, loader: ShardedDataLoader) -> None:
        """A ds_config's ``"auto"`` micro-batch: the first prepared loader's batch size per process."""
        plugin = self.state.deepspeed_plugin
        if plugin is None or self.config.train_micro_batch_size_per_gpu is not None or loader.batch_size is None:
            return
        micro = int(loader.batch_size)
        total = micro * self.gradient_accumulation_steps * self.world_size
        self.config.train_micro_batch_size_per_gpu, self.config.train_batch_size = micro, total
        plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=micro, train_batch_size=total)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Backward passes in the block accumulate gradients locally, without communication; the
        first backward after it reduces everything accumulated (as DDP's ``no_sync``)."""
        context = getattr(model, "no_sync", None)
        with context() if context is not None and self.world_size > 1 else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Backward passes in the block reduce gradients over processes, even of forwards run inside
        ``no_sync`` (several forwards accumulated locally, the last backward synchronises)."""
        context = getattr(model, "trigger_sync_in_backward", None)
        with context() if context is not None else contextlib.nullcontext():
            yield

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16 gradients by the loss scale (once per step; clipping does it itself): ``optimizer``'s
        (a prepared optimizer or a list of them), or every prepared optimizer's."""
        if optimizer is None:
            chosen = self.job.user_optimizers()
        else:
            given = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            chosen = [o.optimizer if isinstance(o, PreparedOptimizer) else o for o in given]
        self.precision.unscale(chosen)

    # ------------------------------------------------------------------ models and state
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module inside a prepared model (its parameters hold this rank's shards;
        use ``full_state_dict`` for full weights). Accelerate's ``keep_fp32_wrapper`` and
        ``keep_torch_compile`` are accepted: xshard wraps no forward (a compiled model is compiled in place)."""
        return getattr(model, "module", model) if any(model is m for m in self.job.models) else model

    def summon_full_params(self, model: torch.nn.Module, writeback: bool = True) -> contextlib.AbstractContextManager:
        """A block in which ``model``'s parameters are whole on this rank (PyTorch FSDP's
        ``summon_full_params``): ``model`` is a prepared model or the user's module inside it
        (``unwrap_model``, a Trainer's ``self.model``); every process must enter it. See
        ``ShardedModel.summon_full_params`` for ``writeback``. A model not prepared here: nothing to do."""
        prepared = next((m for m in self.job.models if model is m or getattr(m, "module", None) is model), None)
        summon = getattr(prepared, "summon_full_params", None)
        return summon(writeback=writeback) if summon is not None else contextlib.nullcontext()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU weights, keys as the user's ``module.state_dict()``; complete on rank 0."""
        if hasattr(model, "full_state_dict"):
            return cast(Any, model).full_state_dict(rank0_only=True)
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def end(self) -> None:
        """Leave the process group, undo the prepared models' backend patches and free the output folders' locks
        (``xshard.checkpoint.output_lock``); safe to call twice."""
        if not self._ended:
            from .checkpoint import output_lock
            from .checkpoint.save_load import wait_for_background_save

            wait_for_background_save(self.job)  # an async save is complete (or its error raised) before the end
            self.wait_for_everyone()
            output_lock.release_all()  # the output folders are free for another job
            self.close_models()
            self._leave()

    def _leave(self) -> None:
        log_for_job(None)
        unshare_with_accelerate()
        self.backend.destroy_process_group()
        self._ended = True

    def close_models(self) -> None:
        """Undo the prepared models' backend patches and hooks (``end`` and ``free_memory`` call it)."""
        self._stale_guard.remove()
        for model in self.job.models:
            close = getattr(model, "close", None)
            if close is not None:
                close()

    if not TYPE_CHECKING:  # hidden from the type checker, so that a misspelt member is an error there
        def __getattr__(self, name: str) -> Any:
            # only reached for names that are not found: Accelerate's members xshard lacks get xshard's way
            from .accelerate_compat.missing import ACCELERATOR_MEMBERS, missing_member

            raise missing_member("Accelerator", name, ACCELERATOR_MEMBERS)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickled as a reference to this process's Accelerator: ``copy.deepcopy`` and the pickling
        that ``datasets.map`` does to hash a function get this same object back. An Accelerator holds
        the process group and the prepared models, so it cannot be rebuilt in another process: there,
        unpickling raises an error saying what to pass instead."""
        return _accelerator_of_this_process, (self._token,)

    def __enter__(self) -> Accelerator:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.end()
        else:  # do not wait at a barrier for ranks that may be gone
            self.close_models()
            self._leave()


#: this process's Accelerators by pickling token (weak: a dropped Accelerator is forgotten)
_LIVE: weakref.WeakValueDictionary[str, Accelerator] = weakref.WeakValueDictionary()


def _accelerator_of_this_process(token: str) -> Accelerator:
    """Unpickle an Accelerator: the live one of this process that was pickled."""
    found = _LIVE.get(token)
    if found is None:
        raise RuntimeError("an Accelerator was unpickled in another process (a DataLoader worker, a spawned "
                           "process): it holds the process group and the prepared models and cannot move; pass "
                           "the values the code needs (accelerator.process_index, num_processes, device ...) "
                           "instead of the Accelerator")
    return found


def _owns(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    ids = {id(p) for p in model.parameters()}
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


def _warn_outside_models(optimizer: torch.optim.Optimizer, models: Sequence[torch.nn.Module]) -> None:
    """Say so at prepare time when an optimizer trains Parameters that no prepared model holds.

    Such Parameters are neither sharded nor averaged over ranks (as with DDP, which syncs only its
    module's), and ``save_state`` refuses them (their optimizer state has no model key to reshard by),
    so the user learns it now rather than at the first save hours later.
    """
    known = {id(p) for model in models for p in model.parameters()}
    outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]
    if outside:
        log.warning("%s holds %d parameter(s) that no prepared model holds (first of shape %s): they are not "
                    "sharded or averaged over ranks, and save_state cannot save their optimizer state; "
                    "make them part of a model passed to prepare()", type(optimizer).__name__, len(outside),
                    tuple(outside[0].shape))


def _is_prepared(obj: Any) -> bool:
    return isinstance(obj, (PreparedOptimizer, PreparedScheduler, ShardedDataLoader))
