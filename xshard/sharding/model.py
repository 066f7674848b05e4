"""shard_model and ShardedModel: the user-facing side of the sharded core."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import generation as _generation
from . import state_dict as _state_dict
from . import stats as _stats
from .buffers import BufferSync
from .engine import Engine
from .grad_clip import clip_grad_norm_
from .groups import ProcessGroups
from .layout import ShardedParamView, ShardLayout
from .materialize import fill_parameters, fill_shards
from .module_sync import sync_module_states
from .options import ShardingOptions
from .params import Rebound
from .plan import GradReduction, ShardingPlan
from .precision import ForwardPrecision, cast_buffers, install_fp32_norms
from .replicate import ReplicatedEngine
from .shard_engine import ShardedEngine
from .sharded_init import RecordedRows, recording_of
from .storage_pool import StoragePool, can_pool
from .unit import Runtime, Unit
from .wrap import split_into_units

if TYPE_CHECKING:  # types only: the core imports nothing of the device layer at run time
    from xshard.backends import Backend

log = logging.getLogger("xshard.sharding")


class ShardedModel(nn.Module):
    """A model whose parameters, gradients and optimizer state are sharded over the backend's ranks.

    Use it like the module it wraps (attribute access falls through to ``.module``). The user's
    ``nn.Parameter`` objects stay valid: at stages 1-3 each holds this rank's dim-0 shard (and its
    ``.grad`` the reduced gradient shard after backward), so an optimizer built before or after
    ``shard_model`` works, param groups included. ``requires_grad`` may change between steps
    (freezing, unfreezing): it takes effect at the next forward. ``state_dict()`` returns whole
    tensors with the user's names (a collective: every rank calls it).
    """

    def __init__(self, module: nn.Module, backend: Backend, options: ShardingOptions) -> None:
        super().__init__()
        self.module = module
        self.backend = backend
        self.options = options
        #: the job's collectives (the whole world: buffers, checks, counters); parameters move over
        #: ``self.groups`` (the shard group, and the replica group with hybrid sharding)
        self.collectives = backend.collectives
        self.plan = ShardingPlan.from_options(options, self.collectives.world_size, backend.world.local_world_size)
        self._optimizers: list[torch.optim.Optimizer] = []
        plan = self.plan
        device = backend.device()
        # Meta-parameter hook: sharded plans give meta parameters empty shards that
        # xshard.sharding.materialize fills; replication and sync_module_states need real values.
        # A model built under sharded_init is filled here from its recording (stage 0: whole values
        # now; stages 1-3: each rank's rows once the units exist), rank 0's with sync_module_states.
        recording = recording_of(module)
        init_rows = None
        rebound = Rebound()
        if recording is not None:
            init_rows = RecordedRows(recording, module, self.collectives if options.sync_module_states else None,
                                     device)
            if not plan.shard_parameters:
                before = dict(module.named_parameters(remove_duplicate=False))
                fill_parameters(module, init_rows)
                after = dict(module.named_parameters(remove_duplicate=False))
                for name, old in before.items():
                    rebound.add(old, after[name])
        has_meta = any(p.is_meta for p in module.parameters())
        if (not plan.shard_parameters or options.sync_module_states) and has_meta and recording is None:
            raise ValueError("the model has parameters on the meta device: stage 0 and sync_module_states need "
                             "real values. Load the weights first, build the model inside sharded_init(), or use "
                             "stage 1-3 and fill the shards with xshard.sharding.materialize "
                             "(xshard.pretrained.from_pretrained_sharded does both)")
        if options.sync_module_states and self.collectives.world_size > 1 and recording is None:
            sync_module_states(module, self.collectives, device, backend.mark_step)
        cast_buffers(module, device, plan.precision.buffer_dtype)
        self.groups = ProcessGroups.make(backend, plan)
        shard = self.groups.shard
        self._rt = Runtime(
            collectives=shard, rank=shard.rank, world_size=shard.world_size,
            device=device, shard_device=torch.device("cpu") if plan.offload else device, plan=plan,
            frees_storage_by_resize=backend.frees_storage_by_resize,
            replicas=self.groups.replicas, post_forward=self.groups.post_forward, rebound=rebound,
            fence=backend.optimization_barrier, compiles_graphs=backend.compiles_graphs,
            pool=StoragePool() if backend.frees_storage_by_resize and not backend.allocator_caches and can_pool() else None,
        )
        specs = split_into_units(module, options)
        if options.activation_checkpointing:
            self._checkpoint_units([s.module for s in specs[1:]])
        precision = plan.precision
        if precision.keep_norms_fp32 and precision.param_dtype not in (None, torch.float32):
            install_fp32_norms(module, precision.param_dtype)
        self.units: list[Unit] = []
        self._engine: Engine
        # the gradient reduction picks the engine (the plan pairs it with the parameters' sharding):
        # reduce-scatter of sharded units (stages 1-3), or DDP's bucketed all-reduce of whole parameters
        if plan.grad_reduction is GradReduction.REDUCE_SCATTER:
            self.units = [Unit(s, self._rt, i) for i, s in enumerate(specs)]
            if self._rt.pool is not None:
                self._rt.pool.make_room([[sp.full_bytes for sp in u.params] for u in self.units])
            self._engine = ShardedEngine(self.units, plan, options)
        else:
            from .params import rehome

            for spec in (ps for unit in specs for ps in unit.params):
                rehome(spec, spec.param.detach().to(device), self._rt.rebound)
            # Stage 0 is DDP: under autocast the gradients are fp32 and DDP reduces them as they are;
            # reduce_dtype asks for fewer bytes (as DDP's bf16 compression hook does).
            self._engine = ReplicatedEngine(module, self.collectives, options.bucket_size_mb, precision.reduce_dtype)
        self._num_units = len(specs)
        log.info("%s: %d unit(s); %s", type(module).__name__, len(specs), plan.describe())
        self._layouts = self._collect_layouts()
        if init_rows is not None and plan.shard_parameters:
            fill_shards(self, init_rows)
        if self.groups.replicas is not None and not options.sync_module_states and (recording is not None or not has_meta):
            self._align_replicas()
        autocast_dtype = precision.autocast_dtype
        self._precision = ForwardPrecision(
            module, lambda: backend.autocast(autocast_dtype, enabled=autocast_dtype is not None),
            precision.output_dtype) if autocast_dtype is not None or precision.output_dtype is not None else None
        self._summoned = False
        self._buffers_sync = BufferSync(module, self.collectives, lambda: self._engine.sync, lambda: self._summoned)
        # not ``_state_dict_hooks``: that name is nn.Module's own table of state-dict hooks
        self._sharded_state_dict = _state_dict.StateDictHooks(self)
        # Sharded gradients must not be reduced again by a script's own step call (xm.optimizer_step
        # on XLA): the backend patches such a call while this model lives (see close()).
        self._step_patch = backend.optimizer_step_patch() if plan.shard_parameters else None
        self._finalizer = weakref.finalize(self, self._step_patch.restore) if self._step_patch else None
        # each forward gathers over the shard group: generate() gathers the whole model once, or keeps
        # every rank stepping (generation.py)
        self._unwrap_generate = (_generation.install(module, lambda: self._summoned, self._generation_decision(),
                                                     lambda: self.summon_full_params(writeback=False))
                                 if plan.reshard_after_forward.frees and self._rt.world_size > 1 else None)
        self._closed = False

    def _generation_decision(self) -> _generation.GatherDecision:
        """Does ``generate()`` gather the whole model once? The option, or the backend's free memory against
        the whole model's compute bytes, agreed by every rank of the shard group."""
        shard = self.groups.shard

        def agree(fits: bool) -> bool:
            flag = torch.tensor([1 if fits else 0], dtype=torch.int32, device=self._rt.device)
            shard.all_reduce(flag, op="min", tag="generate: does the whole model fit on every rank")
            return bool(flag.item())

        return _generation.GatherDecision(
            forced=self.options.generate_gathers_once,
            full_bytes=lambda: sum(sp.full_bytes for unit in self.units for sp in unit.params),
            free_bytes=self.backend.free_memory, agree=agree)

    def _align_replicas(self) -> None:
        """Hybrid sharding: every replica of a shard takes the first replica's values (one broadcast per
        parameter over the replica group), so replicas cannot start apart, e.g. from ranks that built
        the model with different seeds (sync_module_states does this for the whole model instead)."""
        replicas = self.groups.replicas
        assert replicas is not None  # called with hybrid sharding only
        with torch.no_grad():
            for unit in self.units:
                for sp in unit.params:
                    replicas.broadcast(sp.padded, src=0, tag=f"broadcast of replica 0's shard of "
                                                                         f"{sp.spec.fqn}")
        self._engine.shards_changed()

    def _checkpoint_units(self, unit_modules: list[nn.Module]) -> None:
        leaves = [m for m in unit_modules
                  if not any(o is not m and any(o is x for x in m.modules()) for o in unit_modules)]
        if not leaves:  # as the HF Trainer refuses xla_fsdp_grad_ckpt without auto wrap
            raise ValueError(
                f"activation_checkpointing (xla_fsdp_grad_ckpt) checkpoints each auto-wrapped unit, but "
                f"auto_wrap_policy={self.options.auto_wrap_policy!r} made no unit besides the root: use "
                "auto_wrap_policy='transformer' with transformer_layer_cls_to_wrap naming the model's "
                "layer class (default: model._no_split_modules), or 'size' with min_num_params")
        for m in leaves:
            self.backend.checkpoint_wrapper(m)

    def _collect_layouts(self) -> list[ShardedParamView]:
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        if self.units:
            return [ShardedParamView(tuple(names[id(sp.user)]), sp.user, sp.layout)
                    for unit in self.units for sp in unit.params]
        return [ShardedParamView(tuple(names[id(p)]), p, ShardLayout.of(p.shape, 1, 0))
                for p in dict.fromkeys(self.module.parameters())]

    # ------------------------------------------------------------------ module protocol
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._engine.forward_started()
        return self.module(*args, **kwargs)

    if not TYPE_CHECKING:
        # The wrapped module's attributes at run time (``model.config``, ``model.generate``), as DDP's and
        # FSDP's wrappers give them. Hidden from the type checker, which then sees nn.Module's own
        # ``__getattr__`` (tensors and submodules) and no ``Any`` that would accept a misspelt name.
        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._modules["module"], name)

    @property
    def stage(self) -> int:
        """The ZeRO stage (0-3) this model's plan was made from."""
        return self.plan.stage

    @property
    def replica_rank(self) -> int:
        """Which copy of the shards this rank holds: the index of its shard group (0 without hybrid
        sharding). Checkpoints take the shards of replica 0 only."""
        return self.groups.replica_rank

    # ------------------------------------------------------------------ read surface for the core's siblings
    def sharded_params(self) -> list[ShardedParamView]:
        """Every parameter once (tied ones once, with all their names), in unit order, with its layout.

        At stage 0 the layout is a world of one (each rank holds every row).
        """
        return self._layouts

    @property
    def rebound_parameters(self) -> Rebound:
        """Parameters replaced by new ones because they could not take their device data in place (a
        CPU Parameter and an XLA device): optimizers holding the old ones must be rebound
        (``Accelerator.prepare`` does)."""
        return self._rt.rebound

    def shards_changed(self) -> None:
        """The shards were written behind the version counters: gather afresh before the next use."""
        self._engine.shards_changed()

    def raw_state_dict(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the user's module's ``state_dict()`` returns the live shards, no collective."""
        return self._sharded_state_dict.raw()

    # ------------------------------------------------------------------ training
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no communication) until the first backward after the block."""
        return self._engine.no_sync()

    def trigger_sync_in_backward(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes in the block reduce, even of forwards run inside ``no_sync``."""
        return self._engine.trigger_sync_in_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, including full gradients still held from ``no_sync`` micro-steps."""
        super().zero_grad(set_to_none=set_to_none)
        self._engine.zero_grad()

    def full_numel(self, param: torch.Tensor) -> int:
        """Elements of ``param``'s whole tensor (a shard's whole parameter; any other tensor's own count)."""
        for unit in self.units:
            for sp in unit.params:
                if sp.user is param:
                    return int(sp.layout.numel)
        return int(param.numel())

    def local_gradients(self, params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The gradients this rank holds now for ``params`` (default: all), before any reduce.

        Inside an accumulation window (``no_sync``) stages 1-3 keep each unit's full local gradients
        beside the shards; stage 0 keeps them in ``param.grad``. Parameters without one are left out.
        """
        wanted = None if params is None else {id(p) for p in params}
        if not self.units:
            return [p.grad for p in dict.fromkeys(self.module.parameters())
                    if p.grad is not None and (wanted is None or id(p) in wanted)]
        return [sp.full.grad for unit in self.units for sp in unit.params
                if sp.full.grad is not None and (wanted is None or id(sp.user) in wanted)]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over all ranks' shards; every rank returns the same norm."""
        # each shard group holds every gradient once (replicas hold equal copies after the reduce)
        return clip_grad_norm_(
            self.module.parameters(), max_norm, norm_type, self._rt.collectives, self._rt.device,
            sharded=self.plan.shard_parameters and self._rt.world_size > 1,
        )

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count this optimizer's state in ``stats()``, and watch its steps.

        Before each step, the ranks check that they issued the same collectives since the last check
        (data-dependent control flow that made ranks run different units is an error naming the
        units and ranks, not silently mixed-up gradients): at the first step at once, later through the
        collective monitor's thread, with no device read in the step (``backends/collectives/agreement.py``). After each step, units are marked stale,
        so every rank decides to all-gather at the same point even with an optimizer that leaves an
        empty shard untouched (a rank gathering alone would hang).
        """
        if any(o is optimizer for o in self._optimizers):
            return
        self._optimizers.append(optimizer)
        optimizer.register_step_pre_hook(lambda *_: self.collectives.verify_same_collectives())
        optimizer.register_step_post_hook(lambda *_: self._engine.shards_changed())

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Inside the block every parameter is whole on this rank, and forward runs without collectives.

        Every rank must enter it (gathering is a collective); inside, one rank alone may run the model,
        e.g. ``generate()`` on rank 0 at stage 3, which would otherwise wait for the other ranks'
        all-gathers. Costs the whole model's memory on every rank while it lasts; gradients are off.
        As PyTorch FSDP's ``summon_full_params``: with ``writeback`` (the default) changes made to the
        parameters inside are kept, each rank keeping its own rows' changes (make the same change on
        every rank); with ``writeback=False`` they are discarded. At stage 0 the parameters are the
        model's own and changes always stay. Entering it again inside the block does nothing.
        """
        with torch.no_grad(), self._engine.full_params_context(writeback):
            outer, self._summoned = self._summoned, True
            try:
                yield
            finally:
                self._summoned = outer

    def close(self) -> None:
        """Detach the core from the module: remove its hooks and undo backend patches (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._engine.remove_hooks()
        self._buffers_sync.remove()
        self._sharded_state_dict.remove()
        if self._unwrap_generate is not None:
            self._unwrap_generate()
        if self._precision is not None:
            self._precision.remove()
        if self._finalizer is not None:
            self._finalizer()

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, Any]:
        """Communication since ``reset_stats`` and model-state bytes held by this rank.

        ``comm``: bytes and calls per collective kind (ZeRO-paper convention, see
        ``backends/collectives/accounting.py``). Per training step, with psi the parameter bytes in the
        communication dtype padded to dim-0 shards of the shard group (G ranks: the world unless
        hybrid): stage 0 all-reduces the trainable gradients (2 psi); stages 1-2 all-gather psi
        (only after the shards changed) and reduce-scatter the trainable psi (2 psi); stage 3 gathers
        every non-root unit twice and the root unit once (it stays gathered from its forward to the
        end of backward) and reduce-scatters once: 3 psi - psi_root. Frozen parameters are never
        reduced. Hybrid sharding adds ``all_reduce_inter``, the reduced shards averaged across
        replicas: 2 psi_trainable / G (all-reduce counts twice; over the inter-node links), while
        ``all_gather`` and ``reduce_scatter`` stay inside the shard group (a node).
        ``reshard_after_forward=k`` moves backward's all-gathers to ``all_gather_post_forward``
        (psi_k - psi_k,root, psi_k padded to k shards) inside groups of k ranks, leaving psi in
        ``all_gather``. ``state_bytes``: see ``stats.py``. ``gathers``: all-gathers issued ahead of
        need, the most units held at once, and the units passed (gathered and reduced for the ranks that
        ran them, in forward and in backward, by a rank whose batch skipped them: ``canonical.py``).
        """
        return {
            "comm": self.collectives.counter.snapshot(),
            "state_bytes": _stats.state_bytes(self),
            "units": self._num_units,
            "gathers": {"prefetched": self._engine.prefetched, "peak_in_flight": self._engine.peak_in_flight,
                        "passed": self._engine.units_passed()},
            "stage": self.plan.stage,
            "world_size": self.collectives.world_size,
            "shard_group_size": self.plan.shard_group_size,
            "replicas": self.plan.replicas,
        }

    def reset_stats(self) -> None:
        """Zero the communication counters (and the prefetch counters)."""
        self.collectives.counter.reset()
        self._engine.reset_counters()

    # ------------------------------------------------------------------ state dicts
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The user's module's state dict: the user's names and whole tensors on the CPU (a collective)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (each rank keeps its rows) or this rank's pieces, by the user's names."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded state dict on the CPU, keys as the user's ``state_dict()``; every rank must call it.

        Units are gathered one at a time. With ``rank0_only`` other ranks return ``{}``.
        """
        return _state_dict.full_state_dict(self, rank0_only)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's rows of every entry (no communication), keys as ``state_dict()``; the
        replicated entries (buffers, stage 0) whole. ``load_state_dict`` takes it back."""
        return {k: piece.tensor.detach() for k, piece in _state_dict.local_pieces(self).items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state dict; every rank passes the same dict and keeps its shard."""
        _state_dict.load_full_state_dict(self, state_dict)


def shard_model(module: nn.Module, backend: Backend, options: ShardingOptions | None = None) -> ShardedModel:
    """Shard ``module`` over ``backend``'s process group (which must be running) as ``options`` say."""
    options = ShardingOptions() if options is None else options
    options.validate()
    if isinstance(module, ShardedModel):
        raise ValueError("this module is already sharded: pass the original module only once")
    return ShardedModel(module, backend, options)
