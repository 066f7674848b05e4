"""shard_model and ShardedModel: the user-facing side of the sharded core."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..backends.collectives import SingleProcessCollectives
from . import state_dict as _state_dict
from . import stats as _stats
from .engine import ShardEngine
from .grad_clip import clip_grad_norm_
from .options import ShardingOptions
from .precision import cast_buffers, install_fp32_norms
from .replicate import Replicator
from .unit import Runtime, Unit, rehome
from .wrap import split_into_units

log = logging.getLogger("xshard.sharding")


def _sync_module_states(module: nn.Module, collectives, device: torch.device) -> None:
    """Broadcast rank 0's parameters and buffers before sharding, through the compute device
    (NCCL/HCCL cannot send host tensors), one call per tensor."""
    with torch.no_grad():
        for t in list(dict.fromkeys(module.parameters())) + list(module.buffers()):
            staged = t.detach().to(device)
            collectives.broadcast(staged, src=0)
            if staged.data_ptr() != t.data_ptr():
                t.copy_(staged)


class ShardedModel(nn.Module):
    """A model whose parameters, gradients and optimizer state are sharded over the backend's ranks.

    Use it like the module it wraps (attribute access falls through to ``.module``). The user's
    ``nn.Parameter`` objects stay valid: at stages 1-3 each holds this rank's dim-0 shard (and its
    ``.grad`` the reduced gradient shard after backward), so an optimizer built before or after
    ``shard_model`` works, param groups included. Build optimizers from ``model.parameters()``.
    Freeze parameters (``requires_grad=False``) before ``shard_model``: the units decide then
    which parameters get gradient buffers and reduce traffic.
    """

    def __init__(self, module: nn.Module, backend, options: ShardingOptions) -> None:
        super().__init__()
        self.module = module
        self.backend = backend
        self.options = options
        self.collectives = backend.collectives
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stage = int(options.stage)
        device = backend.device()
        offload = options.offload
        if self._stage == 0 and offload:
            raise ValueError("offload_params/offload_optimizer need stage 1, 2 or 3 (stage 0 replicates "
                             "everything on the device): set stage >= 1 or turn offload off")
        # Meta-parameter hook: at stages 1-3 meta parameters get empty shards that
        # xshard.sharding.materialize fills; stage 0 and sync_module_states need real values.
        if (self._stage == 0 or options.sync_module_states) and any(p.is_meta for p in module.parameters()):
            raise ValueError("the model has parameters on the meta device: stage 0 and sync_module_states need "
                             "real values. Load the weights first, or use stage 1-3 and fill the shards with "
                             "xshard.sharding.materialize (xshard.pretrained.from_pretrained_sharded does both)")
        # stage 0 with compute copies in another dtype runs through units that shard nothing
        replicated_units = self._stage == 0 and options.param_dtype not in (
            None, *{p.dtype for p in module.parameters()})
        if options.sync_module_states and self.collectives.world_size > 1:
            _sync_module_states(module, self.collectives, device)
        cast_buffers(module, device, options.buffer_dtype)
        self._rt = Runtime(
            collectives=SingleProcessCollectives() if replicated_units else self.collectives,
            rank=0 if replicated_units else self.collectives.rank,
            world_size=1 if replicated_units else self.collectives.world_size,
            device=device, shard_device=torch.device("cpu") if offload else device, stage=self._stage,
            param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype,
            keep_norms_fp32=options.keep_norms_fp32,
            frees_storage_by_resize=getattr(backend, "frees_storage_by_resize", True),
            replicate_over=self.collectives if replicated_units else None,
        )
        specs = split_into_units(module, options)
        if options.activation_checkpointing:
            unit_modules = [s.module for s in specs[1:]]
            leaves = [m for m in unit_modules
                      if not any(o is not m and any(o is x for x in m.modules()) for o in unit_modules)]
            if not leaves:  # as the HF Trainer refuses xla_fsdp_grad_ckpt without auto wrap
                raise ValueError(
                    f"activation_checkpointing (xla_fsdp_grad_ckpt) checkpoints each auto-wrapped unit, but "
                    f"auto_wrap_policy={options.auto_wrap_policy!r} made no unit besides the root: use "
                    "auto_wrap_policy='transformer' with transformer_layer_cls_to_wrap naming the model's "
                    "layer class (default: model._no_split_modules), or 'size' with min_num_params")
            for m in leaves:
                backend.checkpoint_wrapper(m)
        if options.keep_norms_fp32 and options.param_dtype not in (None, torch.float32):
            install_fp32_norms(module, options.param_dtype)
        self.units: list[Unit] = []
        if self._stage == 0 and not replicated_units:
            for spec in (ps for unit in specs for ps in unit.params):
                rehome(spec, spec.param.detach().to(device))
            self._engine: Any = Replicator(module, self.collectives, options.bucket_size_mb, options.reduce_dtype)
            self._num_units = len(specs)
        else:
            self.units = [Unit(s, self._rt, is_root=(i == 0)) for i, s in enumerate(specs)]
            self._engine = ShardEngine(self.units, options)
            self._num_units = len(self.units)
        # Sharded gradients must not be reduced again by a script's own step call (xm.optimizer_step
        # on XLA): backends that have such a call patch it while this model lives (see close()).
        patch = getattr(backend, "patch_optimizer_step", None) if self._stage >= 1 else None
        self._step_patch = patch() if patch is not None else None
        self._finalizer = weakref.finalize(self, self._step_patch.restore) if self._step_patch else None

    # ------------------------------------------------------------------ module protocol
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    @property
    def stage(self) -> int:
        """The ZeRO stage (0-3) this model runs."""
        return self._stage

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) until the first backward after the block."""
        old = self._engine.sync
        self._engine.sync = False
        try:
            yield
        finally:
            self._engine.sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, including full gradients still held from ``no_sync`` micro-steps."""
        super().zero_grad(set_to_none=set_to_none)
        for unit in self.units:
            for sp in unit.params:
                sp.full.grad = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over all ranks' shards; every rank returns the same norm."""
        return clip_grad_norm_(
            self.module.parameters(), max_norm, norm_type, self.collectives, self._rt.device,
            sharded=self._stage >= 1 and self.collectives.world_size > 1,
        )

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count this optimizer's state in ``stats()``, and refresh the compute copies after its steps.

        Stages 1-2 notice updated shards through their version counters; a step hook also marks
        the units stale, so every rank decides to all-gather at the same point even with an
        optimizer that leaves an empty shard untouched (a rank gathering alone would hang).
        """
        if any(o is optimizer for o in self._optimizers):
            return
        self._optimizers.append(optimizer)
        if self.units:
            optimizer.register_step_post_hook(lambda *_: self._mark_stale())

    def _mark_stale(self) -> None:
        for unit in self.units:
            unit.stale = True

    def close(self) -> None:
        """Detach the core from the module: remove its hooks and undo backend patches (idempotent).

        Undoes the backend's step patch (``xm.optimizer_step`` on XLA) that stages 1-3 hold while
        the model lives; ``Accelerator.end()`` calls this, and so does garbage collection.
        """
        self._engine.remove_hooks()
        if self._finalizer is not None:
            self._finalizer()

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, Any]:
        """Communication since ``reset_stats`` and model-state bytes held by this rank.

        ``comm``: bytes and calls per collective kind (ZeRO-paper convention, see
        ``backends/collectives.py``). Per training step, with psi the parameter bytes in the
        communication dtype padded to dim-0 shards: stage 0 all-reduces the trainable gradients
        (2 psi); stages 1-2 all-gather psi (only after the shards changed) and reduce-scatter the
        trainable psi (2 psi); stage 3 gathers every non-root unit twice and the root unit once (it
        stays gathered from its forward to the end of backward) and reduce-scatters once:
        3 psi - psi_root. Frozen parameters are never reduced. ``state_bytes``: see ``stats.py``.
        ``gathers``: all-gathers issued ahead of need and the most units held at once.
        """
        return {
            "comm": self.collectives.counter.snapshot(),
            "state_bytes": _stats.state_bytes(self),
            "units": self._num_units,
            "gathers": {"prefetched": getattr(self._engine, "prefetched", 0),
                        "peak_in_flight": getattr(self._engine, "peak_in_flight", 0)},
            "stage": self._stage,
            "world_size": self.collectives.world_size,
        }

    def reset_stats(self) -> None:
        """Zero the communication counters (and the prefetch counters)."""
        self.collectives.counter.reset()
        if isinstance(self._engine, ShardEngine):
            self._engine.prefetched = self._engine.peak_in_flight = 0

    # ------------------------------------------------------------------ state dicts
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded state dict on the CPU, keys as ``module.state_dict()``; every rank must call it.

        Units are gathered one at a time. With ``rank0_only`` other ranks return ``{}``.
        """
        return _state_dict.full_state_dict(self, rank0_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state dict; every rank passes the same dict and keeps its shard."""
        _state_dict.load_full_state_dict(self, state_dict)


def shard_model(module: nn.Module, backend, options: ShardingOptions | None = None) -> ShardedModel:
    """Shard ``module`` over ``backend``'s process group (which must be running) as ``options`` say."""
    options = ShardingOptions() if options is None else options
    options.validate()
    if isinstance(module, ShardedModel):
        raise ValueError("this module is already sharded: pass the original module only once")
    return ShardedModel(module, backend, options)
