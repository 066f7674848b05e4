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
- ``autocast()`` enters the backend's autocast in the config's mixed-precision dtype. At stages
  1-3 the sharded core already computes in that dtype (``param_dtype``); autocast adds what it
  cannot: fp32 inputs and tensors created inside the forward are cast to match, and numerically
  sensitive ops (softmax, norms, losses) run in fp32. At stage 0 the replicated parameters keep
  their dtype and autocast is what gives mixed precision. With ``mixed_precision="no"`` it does
  nothing. So the loop should always use it; it costs nothing when precision is fp32.
- ``config.gradient_clipping`` > 0 clips inside ``optimizer.step()`` when the loop did not call
  ``clip_grad_norm_`` itself in that step.
- ``gather``/``reduce`` use the backend's collectives, whose byte counter the core's ``stats()``
  may share: call them outside the window you measure.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import os
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .backends import Backend, select
from .data import ShardedDataLoader, shard_data_loader
from .job import JobState
from .log import get_logger, progress, setup_logging
from .prepared import PreparedOptimizer, PreparedScheduler

log = get_logger("xshard.accelerator")

_MIXED_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load_config(config: Any, overrides: dict[str, Any]) -> Any:
    from .config import XShardConfig

    if isinstance(config, XShardConfig) and not overrides:
        return config
    return XShardConfig.load(config, overrides=overrides or None, env=os.environ)


class Accelerator:
    """One training job on one backend: process group, device, sharding, precision, accumulation.

    Args:
        config: an xshard config file (or a DeepSpeed ``ds_config.json`` / accelerate FSDP yaml),
            a dict, an ``XShardConfig``, or None (defaults; ``XSHARD_CONFIG`` and ``XSHARD_*``
            environment variables apply in every case).
        backend: "auto" | "cpu" | "cuda" | "npu" | "mps" | "xla"; None follows ``XSHARD_BACKEND``.
        seed: seeds torch, the device, ``random`` and numpy on every rank (the same seed, so every
            rank builds the same initial model) and the data loaders' shuffles (default: the
            config's ``seed``). Without a seed nothing is seeded, the shuffle seed is 0, and
            ``prepare`` broadcasts rank 0's weights so that every rank starts from the same model.
        timeout: process-group timeout (seconds or a timedelta) for a hung collective.
        log_level / log_level_replica / log_on_each_node: see ``xshard.log``.
        **overrides: config fields, e.g. ``stage=2, gradient_accumulation_steps=4``.
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
        self.config = _load_config(config, overrides)
        config_backend = None if self.config.backend == "auto" else self.config.backend
        selection = select(backend if backend is not None else config_backend)
        # The backend knows where this process sits in the job (torchrun's variables, or torch_xla's
        # runtime under its own launcher).
        self.backend: Backend = selection.cls()
        world = self.backend.world
        setup_logging(world.rank, world.local_rank, world.world_size,
                      log_level if log_level is not None else self.config.log_level,  # file < env < argument
                      log_level_replica, log_on_each_node)
        self.backend.init_process_group(timeout=timeout)
        self.device: torch.device = self.backend.device()
        log.info("backend %s (%s) on %s, %d process(es)", self.backend.name, selection.reason, self.device,
                 world.world_size)

        chosen_seed = seed if seed is not None else self.config.seed
        #: None when nothing seeds the processes; then prepare() broadcasts rank 0's weights
        self.seeded = chosen_seed is not None
        self.seed = int(chosen_seed) if chosen_seed is not None else 0  # also the data shuffle seed
        if self.seeded:
            self._seed_everything(self.seed)

        mixed = self.config.mixed_precision  # validated by the config: no, bf16 or fp16
        self.mixed_precision = mixed
        self.compute_dtype: torch.dtype | None = _MIXED_DTYPES[mixed]
        if self.compute_dtype is not None and not self.backend.supports(self.compute_dtype):
            usable = [name for name, dtype in _MIXED_DTYPES.items() if dtype is None or self.backend.supports(dtype)]
            raise ValueError(
                f"mixed_precision={mixed!r}: the {self.backend.name} backend cannot compute in {self.compute_dtype}; "
                f"use one of: {', '.join(usable)}"
            )
        #: prepared objects, step counters and the accumulation window (see ``xshard.job``)
        self.job = JobState(
            backend=self.backend, config=self.config,
            gradient_accumulation_steps=int(self.config.gradient_accumulation_steps),
            gradient_clipping=float(self.config.gradient_clipping or 0.0),
            scaler=self._make_scaler() if mixed == "fp16" else None,
        )
        self._ended = False

    # ------------------------------------------------------------------ facts
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
    def sync_gradients(self) -> bool:
        """True on micro-steps that end an accumulation window (the optimizer really steps)."""
        return self.job.sync_gradients

    @property
    def step(self) -> int:
        """Real optimizer steps taken (saved in checkpoints; orders them for ``resume_from_checkpoint``)."""
        return self.job.step

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step (from the config)."""
        return self.job.gradient_accumulation_steps

    @property
    def gradient_clipping(self) -> float:
        """Max global gradient norm applied at each step when the loop does not clip (0: none)."""
        return self.job.gradient_clipping

    @property
    def scaler(self) -> Any:
        """The fp16 grad scaler (None unless mixed_precision is fp16)."""
        return self.job.scaler

    # ------------------------------------------------------------------ setup helpers
    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        try:
            import numpy as np

            np.random.seed(seed % 2**32)
        except ImportError:
            pass
        self.backend.manual_seed(seed)

    def _make_scaler(self) -> Any:
        from .sharding import ShardedGradScaler

        return ShardedGradScaler(self.backend)

    def sharding_options(self) -> Any:
        """The core's ShardingOptions from this config, adjusted to this job.

        - Stage 0 keeps the parameters' dtype (the replicated core has no compute copy to cast);
          mixed precision there comes from ``autocast()`` alone.
        - Unseeded multi-process jobs broadcast rank 0's initial weights (``sync_module_states``),
          as DDP does, since each rank built its model from different random numbers.
        """
        opts = self.config.to_sharding_options()
        if opts.stage == 0:
            opts.param_dtype = None
        if not self.seeded and self.world_size > 1:
            opts.sync_module_states = True
        return opts

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objs: Any) -> Any:
        """Prepare models, optimizers, data loaders and LR schedulers (any order, any number).

        Returns them in the order given (one object alone is returned as itself). Models are
        sharded (``shard_model``) and their original ``nn.Parameter`` objects hold this rank's
        shard, so an optimizer built before ``prepare`` keeps working.
        """
        out: list[Any] = list(objs)
        order = (
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
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard ``model`` over the job with the config's sharding options."""
        from .sharding import ShardedModel, shard_model

        if any(model is m for m in self.job.models):
            return model
        sharded = model if isinstance(model, ShardedModel) else shard_model(model, self.backend, self.sharding_options())
        self.job.models.append(sharded)
        for opt in self.job.optimizers:  # an optimizer prepared before its model
            if opt.model is None and _owns(sharded, opt.optimizer):
                opt.model = sharded
                sharded.register_optimizer(opt.optimizer)
        return sharded

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap ``optimizer``: steps through the backend and the grad scaler, only on sync steps."""
        model = next((m for m in self.job.models if _owns(m, optimizer)), None)
        if model is not None:
            model.register_optimizer(optimizer)
        prepared = PreparedOptimizer(optimizer, self.job, model)
        self.job.optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        """Wrap an LR scheduler so it steps only when its optimizer really stepped."""
        owner = next((o for o in self.job.optimizers if o.optimizer is scheduler.optimizer), None)
        prepared = PreparedScheduler(scheduler, owner)
        self.job.schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, loader: DataLoader, shard: bool = True) -> ShardedDataLoader:
        """Give ``loader`` this rank's slice of every epoch (``xshard.data``) and device placement.

        ``loader.batch_size`` is per process: the global batch is ``batch_size * world_size``.
        """
        prepared = shard_data_loader(
            loader, self.device, num_replicas=self.world_size, rank=self.rank, seed=self.seed,
            wrap=self.backend.wrap_dataloader, shard=shard,
        )
        self.job.loaders.append(prepared)
        return prepared

    # ------------------------------------------------------------------ the training step
    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-step: gradients are synchronised only at the end of an accumulation window."""
        self.job.begin_micro_step(end_of_epoch=self.job.end_of_epoch())
        with contextlib.ExitStack() as stack:
            if not self.job.sync_gradients:
                for model in models or self.job.models:
                    no_sync = getattr(model, "no_sync", None)
                    if no_sync is not None:
                        stack.enter_context(no_sync())
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided over the accumulation window and scaled for fp16."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The backend's autocast in the config's mixed-precision dtype (nothing for "no")."""
        return self.backend.autocast(self.compute_dtype, enabled=self.compute_dtype is not None)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip gradients to a global norm over all shards (every rank agrees); returns the norm.

        On micro-steps inside an accumulation window it does nothing and returns None. For a
        prepared model, the whole model's gradients are clipped (the core computes one norm).
        """
        if not self.job.sync_gradients:
            return None
        return self.job.clip_grad_norm_(parameters, max_norm, norm_type)

    # ------------------------------------------------------------------ collectives and processes
    def gather(self, data: Any) -> Any:
        """Concatenate every rank's tensor(s) along dim 0 (0-dim tensors become a vector of W values).

        Works on nested dicts/lists/tuples of tensors; shapes must match across ranks.
        """
        return _map_tensors(data, self._gather_one)

    def _gather_one(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(self.device)
        t = t.reshape(1) if t.dim() == 0 else t.contiguous()
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        self.backend.collectives.all_gather_into_tensor(out, t)
        return out

    def reduce(self, data: Any, reduction: str = "mean") -> Any:
        """Sum or average tensor(s) over ranks; returns new tensors (the inputs are left alone)."""
        ops = {"mean": "avg", "sum": "sum"}
        if reduction not in ops:
            raise ValueError(f"reduce(reduction={reduction!r}): use 'mean' or 'sum'")

        def one(t: torch.Tensor) -> torch.Tensor:
            out = t.detach().to(self.device).clone()
            if not out.is_floating_point() and reduction == "mean":
                out = out.float()
            self.backend.collectives.all_reduce(out, op=ops[reduction])
            return out

        return _map_tensors(data, one)

    def wait_for_everyone(self) -> None:
        """Barrier: every rank waits until all reach this point."""
        if self.world_size > 1:
            self.backend.collectives.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on rank 0 first, then on the others (e.g. to download or preprocess once)."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    def progress(self, iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
        """A tqdm progress bar shown on the main process only."""
        return progress(iterable, **kwargs)

    # ------------------------------------------------------------------ models and state
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside a prepared model (its parameters hold this rank's shards;
        use ``full_state_dict`` for full weights)."""
        return getattr(model, "module", model) if any(model is m for m in self.job.models) else model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU weights, keys as the user's ``module.state_dict()``; complete on rank 0."""
        if hasattr(model, "full_state_dict"):
            return model.full_state_dict(rank0_only=True)
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def save_state(self, directory: str | os.PathLike, state_dict_type: str | None = None,
                   save_total_limit: int | None = None) -> Path:
        """Save models, optimizers, schedulers, loaders' positions, scaler, RNG and step to ``directory``.

        Atomic: the folder appears complete or not at all. ``state_dict_type`` ("full", "local",
        "sharded"; default: the config's, "full": one plain model.safetensors, resumable on any world
        size and stage) is described in ``xshard.checkpoint.formats``.
        ``save_total_limit`` keeps only the newest N complete checkpoints in ``directory``'s parent.
        Every rank must call it. Returns the checkpoint's path.
        """
        from .checkpoint import save_state

        return save_state(self.job, directory, state_dict_type, save_total_limit)

    def load_state(self, directory: str | os.PathLike, resume_from_checkpoint: bool = False, *,
                   missing_ok: bool = False) -> Path | None:
        """Restore everything ``save_state`` wrote; returns the folder loaded.

        With ``resume_from_checkpoint=True``, ``directory`` is the output folder that holds the
        checkpoints: the newest complete one is loaded (incomplete ones are skipped with a warning).
        A folder that does not exist or holds no checkpoint is an error naming it (a mistyped path
        never restarts training from scratch); ``missing_ok=True`` instead returns None and loads
        nothing, for a script whose first run has no checkpoint yet. The default ("full") and
        "sharded" checkpoints load on any world size and stage; "local" ones need the same world
        size and stage. A folder written by Accelerate for an FSDP model loads too. A bad
        checkpoint raises ``xshard.checkpoint.CheckpointError`` naming the file and key, and
        changes nothing.
        """
        from .checkpoint import load_state, resume

        if resume_from_checkpoint:
            return resume(self.job, directory, missing_ok=missing_ok)
        return load_state(self.job, directory, missing_ok=missing_ok)

    def end(self) -> None:
        """Leave the process group and undo the prepared models' backend patches (safe to call twice)."""
        if not self._ended:
            self.wait_for_everyone()
            self._close_models()
            self.backend.destroy_process_group()
            self._ended = True

    def _close_models(self) -> None:
        for model in self.job.models:
            close = getattr(model, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Accelerator:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.end()
        else:  # do not wait at a barrier for ranks that may be gone
            self._close_models()
            self.backend.destroy_process_group()
            self._ended = True


def _owns(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    ids = {id(p) for p in model.parameters()}
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


def _is_prepared(obj: Any) -> bool:
    return isinstance(obj, (PreparedOptimizer, PreparedScheduler, ShardedDataLoader))


def _map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return {k: _map_tensors(v, fn) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(v, fn) for v in data)
    raise TypeError(f"expected tensors (or dicts/lists/tuples of them), got {type(data).__name__}")
