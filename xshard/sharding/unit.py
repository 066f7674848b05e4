"""A unit at run time: its parameters' shards and full copies, one all-gather and one reduce per step.

A unit is gathered and reduced as one collective operation each. Its state is explicit:

    SHARDED --start_gather--> GATHERING --wait_gather--> GATHERED --reshard--> SHARDED

A gathered copy is never older than its shard: every gather records the shards' version counters
(and the optimizer's step hook marks units stale), and ``wait_gather`` gathers again when a shard
changed after the gather was issued, e.g. a unit prefetched in a step where it did not run and
updated by the optimizer before its next use.

Gradients (``start_reduce``): each trainable parameter's full gradient is averaged over ranks (a
reduce-scatter: each rank keeps its shard). Parameters that got no gradient on a rank contribute
zeros, and a flag per parameter travels in the same collective, so after the reduce each rank knows
whether any rank produced a gradient: a parameter used on no rank keeps ``grad is None`` (AdamW's
decay and momentum then leave it alone, as in plain PyTorch and DDP); one used on some ranks gets
the average, as in DDP. The flags are read on the host only when this rank lacked a gradient.

Hybrid sharding: ``rt.collectives`` is the shard group, so gathers and reduce-scatters stay inside
it; the reduced shards (and the flags) of one reduce lie in one flat buffer, which is then averaged
across the replica group (``rt.replicas``) with one all-reduce. That all-reduce can only start
once the reduce-scatter is done: ``PendingReduce.launch_inter`` starts it, and the engine calls it
for the earlier units while a later unit's reduce-scatter is in flight.

``reshard_after_forward=k``: ``reshard(keep_post_forward=True)`` (after forward) keeps this rank's
1/k piece of the freshly used full copies before freeing them, and the next gather (backward's)
all-gathers those pieces within the post-forward group (``rt.post_forward``) instead of gathering the
shards over the whole shard group, as long as the shards have not changed since; any other reshard
drops the pieces.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from .layout import FlatLayout
from .params import Rebound, ShardedParam
from .plan import ShardingPlan
from .storage_pool import StoragePool
from .wrap import UnitSpec, param_owner_is_norm

if TYPE_CHECKING:  # types only: the core imports nothing of the device layer at run time
    from xshard.backends import Collectives, Handle


class UnitState(enum.Enum):
    """Where a unit's full copies are."""

    SHARDED = "sharded"  # only shards (full storage freed, or never gathered)
    GATHERING = "gathering"  # an all-gather is in flight
    GATHERED = "gathered"  # full copies hold the gathered values


class BackwardState(enum.Enum):
    """Where a unit is in the current backward."""

    IDLE = "idle"  # not reached yet (or no backward in progress)
    RUNNING = "running"  # its outputs' gradients arrived; its own gradients are being computed
    DONE = "done"  # its gradients are complete (reduced, or held for the end of backward)


@dataclass
class Runtime:
    """What every unit of one sharded model shares."""

    collectives: Collectives  # the shard group's (the world's without hybrid sharding)
    rank: int  # in the shard group
    world_size: int  # of the shard group
    device: torch.device  # compute device
    shard_device: torch.device  # where master shards, gradient shards and optimizer state live
    plan: ShardingPlan
    frees_storage_by_resize: bool = True
    #: the replica group's collectives (hybrid sharding), None with one replica
    replicas: Collectives | None = None
    #: the post-forward group's collectives (reshard_after_forward=k), None otherwise
    post_forward: Collectives | None = None
    #: Parameters replaced where a device could not take their data in place
    rebound: Rebound = field(default_factory=Rebound)
    #: the backend's optimization barrier (in place; a no-op on eager devices): fences each unit's
    #: collectives so that a graph compiler keeps one unit's full parameters alive at a time
    fence: Callable[[list[torch.Tensor]], None] = lambda tensors: None
    #: the device compiles whole graphs (XLA): the compiler schedules the collectives, so the core
    #: issues no gather ahead (a prefetched gather would only keep two units' parameters alive)
    compiles_graphs: bool = False
    #: freed full-parameter memory kept for the next gather (the CPU: see storage_pool), or None
    pool: StoragePool | None = None


class Unit:
    """The parameters of one module, gathered and reduced together (one collective operation each)."""

    def __init__(self, spec: UnitSpec, rt: Runtime, index: int) -> None:
        self.module = spec.module
        self.name = spec.name or "<root>"
        self.index = index
        self.is_root = index == 0
        self.rt = rt
        precision = rt.plan.precision
        reshard = rt.plan.reshard_after_forward
        resident = not reshard.frees
        self.params: list[ShardedParam] = []
        for ps in spec.params:
            dtype = precision.param_dtype or ps.param.dtype
            if precision.keep_norms_fp32 and param_owner_is_norm(ps) and ps.param.is_floating_point():
                dtype = torch.float32
            if not ps.param.is_floating_point():
                dtype = ps.param.dtype
            self.params.append(ShardedParam(ps, rt.world_size, rt.rank, rt.device, rt.shard_device, dtype,
                                            resident, rt.frees_storage_by_resize, rt.rebound,
                                            reshard.post_forward_group_size))
        self.state = UnitState.GATHERED if resident else UnitState.SHARDED
        self.stamp: tuple[int, ...] | None = self.versions() if resident else None
        # True when the full copies may not match the shards: resident copies start from this rank's
        # own values, so the first forward gathers (ranks agree even without sync_module_states);
        # also set by the optimizer's step hook and by writes behind the version counters
        self.stale = resident
        self._pending: tuple[Handle, list[torch.Tensor]] | None = None  # (handle, targets) while GATHERING
        #: the shards' versions when the post-forward pieces were cut (None: no pieces held)
        self._post_stamp: tuple[int, ...] | None = None
        self.backward = BackwardState.IDLE
        self.pending_backward_calls = 0
        #: the full copies are registered in the modules (between ``swap_in`` and ``swap_out``)
        self.swapped = False
        self.trainable: list[ShardedParam] = []
        self.refresh_trainable()
        if not resident:
            for sp in self.params:
                self._free(sp)

    # ------------------------------------------------------------------ trainability
    def refresh_trainable(self) -> bool:
        """Follow the user's ``requires_grad`` (frozen: no gradient, no reduce traffic); True if it changed."""
        changed = any([sp.sync_requires_grad() for sp in self.params])
        trainable = [sp for sp in self.params if sp.trainable]
        if changed or trainable != self.trainable:
            self.trainable = trainable
            return True
        return False

    def reduce_groups(self) -> list[tuple[torch.dtype, list[ShardedParam]]]:
        """Trainable parameters grouped by the dtype their gradients are reduced in."""
        precision = self.rt.plan.precision
        groups: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in self.trainable:
            dtype = precision.reduce_dtype or precision.param_dtype or sp.gather_dtype
            groups.setdefault(dtype, []).append(sp)
        return list(groups.items())

    # ------------------------------------------------------------------ state
    def versions(self) -> tuple[int, ...]:
        return tuple(sp.version() for sp in self.params)

    def is_current(self) -> bool:
        """Do the gathered full copies hold the shards' current values?"""
        return self.state is UnitState.GATHERED and not self.stale and self.stamp == self.versions()

    # ------------------------------------------------------------------ gather
    def start_gather(self, after: list[torch.Tensor] | tuple = ()) -> bool:
        """Issue this unit's all-gather (asynchronous) unless it is gathering or current; True if issued.

        ``after``: tensors the gather must follow (the unit's forward inputs): fenced with the shards,
        so a graph compiler cannot gather this unit before the previous one produced them.

        Each parameter is gathered straight into its full copy's storage: this rank's shard is written
        (cast to the compute dtype) into its own slice, which is the all-gather's input, so there is no
        send buffer and no receive buffer to copy out of (the collectives may still pack where one large
        operation is cheaper, e.g. NCCL).
        """
        if not self.params or self.state is UnitState.GATHERING or self.is_current():
            return False
        rt = self.rt
        from_pieces = self._post_forward_current()
        collectives = rt.post_forward if from_pieces else rt.collectives
        assert collectives is not None  # pieces are kept only where there is a post-forward group
        sources = [sp.post_forward if from_pieces else sp.padded for sp in self.params]
        rt.fence(cast("list[torch.Tensor]", sources) + list(after))
        targets, inputs = [], []
        with torch.no_grad():
            for sp, source in zip(self.params, sources, strict=True):
                lay = sp.post_layout if from_pieces else sp.layout
                assert lay is not None and source is not None  # a current piece has both
                seg = lay.seg
                if sp.gather_target is not None:
                    self._alloc(sp)
                    target = sp.gather_target[: lay.gather_numel]
                    own = target[lay.rank * seg:(lay.rank + 1) * seg]
                    own.copy_(source, non_blocking=True)
                else:  # the full copy takes the target's data once the gather is done
                    target = torch.empty(lay.gather_numel, dtype=sp.gather_dtype, device=rt.device)
                    own = source.to(device=rt.device, dtype=sp.gather_dtype)
                targets.append(target)
                inputs.append(own)
        what = "post-forward pieces of unit" if from_pieces else "unit"
        handle = collectives.all_gather_into_tensors(targets, inputs, async_op=True, tag=f"all-gather of {what} {self.name}")
        self._drop_post_forward()
        self._pending = (handle, targets)
        self.stamp = self.versions()
        self.stale = False
        self.state = UnitState.GATHERING
        return True

    def finish_gather(self) -> None:
        """Complete an in-flight gather (nothing else): the copies are as of when it was issued."""
        if self.state is not UnitState.GATHERING or self._pending is None:
            return
        handle, targets = self._pending
        self._pending = None
        handle.wait()
        self.rt.fence(targets)
        if not self.rt.frees_storage_by_resize:
            for sp, target in zip(self.params, targets, strict=True):
                sp.full.data = target[: sp.layout.numel].view(sp.layout.shape)
        self.state = UnitState.GATHERED

    def wait_gather(self, after: list[torch.Tensor] | tuple = ()) -> None:
        """Make the full parameters usable and current: finish an in-flight gather, and gather (again)
        when the shards changed since (or nothing was gathered); ``after`` as in ``start_gather``."""
        self.finish_gather()
        if self.params and not self.is_current():
            self.start_gather(after)
            self.finish_gather()

    def reshard(self, keep_post_forward: bool = False, before: list[torch.Tensor] | tuple = ()) -> None:
        """Free the full copies (a gather in flight is finished first: its collective must complete).

        ``keep_post_forward`` (after a forward that a backward follows, with ``reshard_after_forward=k``):
        keep this rank's piece of the current full copies for backward's gather within the
        post-forward group. Otherwise any pieces held are dropped too.
        """
        if self.state is UnitState.SHARDED:
            if not keep_post_forward:
                self._drop_post_forward()
            return
        self.finish_gather()
        if keep_post_forward and self.rt.post_forward is not None and self.is_current():
            self._keep_post_forward()
        else:
            self._drop_post_forward()
        for sp in self.params:
            self._free(sp)
        # ``before`` (the unit's forward outputs): what follows them cannot share the graph's time with
        # this unit's full parameters (torch_xla's FSDP fences the outputs and shards the same way)
        self.rt.fence([sp.padded for sp in self.params] + list(before))
        self.state = UnitState.SHARDED

    def _keep_post_forward(self) -> None:
        """Cut this rank's post-forward piece out of each (current) full copy, in the compute dtype."""
        with torch.no_grad():
            for sp in self.params:
                lay = sp.post_layout
                assert lay is not None  # pieces are cut only where there is a post-forward group
                piece = torch.zeros(lay.seg, dtype=sp.gather_dtype, device=self.rt.device)
                start = lay.start * lay.row_numel
                piece[: lay.local_numel].copy_(sp.full.detach().reshape(-1)[start:start + lay.local_numel])
                sp.post_forward = piece
        self._post_stamp = self.stamp

    def _drop_post_forward(self) -> None:
        if self._post_stamp is None:
            return
        for sp in self.params:
            sp.post_forward = None
        self._post_stamp = None

    def _post_forward_current(self) -> bool:
        """Are post-forward pieces held, cut from the shards' current values?"""
        return self._post_stamp is not None and not self.stale and self._post_stamp == self.versions()

    def _free(self, sp: ShardedParam) -> None:
        if self.rt.pool is not None:
            self.rt.pool.free(sp.full.untyped_storage())
        elif self.rt.frees_storage_by_resize:
            sp.full.untyped_storage().resize_(0)
        else:  # devices without resizable storage (XLA): drop the data, keep the Parameter object
            sp.full.data = torch.empty(0, dtype=sp.gather_dtype, device=self.rt.device)

    def _alloc(self, sp: ShardedParam) -> None:
        storage = sp.full.untyped_storage()
        if storage.size() == 0:
            if self.rt.pool is not None:
                self.rt.pool.alloc(storage, sp.full_bytes)
            else:
                storage.resize_(sp.full_bytes)

    def live_full_bytes(self, sp: ShardedParam) -> int:
        """Bytes of ``sp``'s full compute copy allocated right now (0 when freed)."""
        if self.rt.frees_storage_by_resize:
            return sp.full.untyped_storage().size()
        return sp.full.numel() * sp.full.element_size()

    # ------------------------------------------------------------------ swap
    def swap_in(self) -> None:
        for sp in self.params:
            sp.swap(True)
        self.swapped = True

    def swap_out(self) -> None:
        for sp in self.params:
            sp.swap(False)
        self.swapped = False

    def write_back(self) -> None:
        """Copy into each shard the elements of its rows that differ in the full copy (a change made
        while the parameters were whole); untouched elements keep their values, so a full copy in a
        lower compute dtype does not round the master shard."""
        with torch.no_grad():
            for sp in self.params:
                lay = sp.layout
                if not lay.local_numel:
                    continue
                start = lay.start * lay.row_numel
                rows = sp.full.detach().reshape(-1)[start:start + lay.local_numel]
                shard = sp.padded[: lay.local_numel]
                old = shard.to(device=rows.device, dtype=rows.dtype)
                new = torch.where(rows != old, rows.to(shard.dtype), shard.to(rows.device))
                shard.copy_(new)

    def drop_full_grads(self) -> None:
        """Forget full gradients held between micro-steps (``zero_grad``)."""
        for sp in self.params:
            sp.full.grad = None

    # ------------------------------------------------------------------ reduce
    def start_reduce(self) -> PendingReduce | None:
        """Hand the full gradients to the reduce-scatter (asynchronous) and drop them from the full copies.

        A gradient already in the reduce dtype, contiguous and of ``world_size`` whole shards is the
        reduce's input itself (the collectives may reduce it in place): no packing buffer. Only padded
        or cast gradients are copied, into a zero-padded buffer of their own.
        """
        if not self.trainable:
            return None
        rt = self.rt
        world = rt.collectives.world_size
        groups = []
        with torch.no_grad():
            for dtype, sps in self.reduce_groups():
                used = [sp.full.grad is not None for sp in sps]
                inputs = [_reduce_input(sp.full.grad, sp.layout.gather_numel, dtype, rt.device) for sp in sps]
                # the reduced shards and the flags: views of one buffer (the replicas' all-reduce takes it whole)
                sizes = [sp.layout.seg for sp in sps] + [len(sps)]
                flat = torch.empty(sum(sizes), dtype=dtype, device=rt.device)
                outputs = list(flat.split(sizes))
                for sp in sps:
                    sp.full.grad = None
                # one flag per parameter, repeated for every rank's slice: each rank receives the
                # average over ranks of "had a gradient" (> 0: some rank used it)
                inputs.append(used_flags(used, world, dtype, rt.device))
                rt.fence(inputs)
                handle = rt.collectives.reduce_scatter_tensors(
                    outputs, inputs, op="avg", async_op=True, tag=f"reduce-scatter of unit {self.name}")
                groups.append(_PendingGroup(sps, handle, outputs, inputs, all(used), flat))
        return PendingReduce(self, groups)

    def accumulate_grads(self, sps: list[ShardedParam], outs: list[torch.Tensor], used: list[bool]) -> None:
        """Add this rank's reduced shard of each used parameter's gradient to ``param.grad``."""
        with torch.no_grad():
            for out, sp, was_used in zip(outs, sps, used, strict=True):
                if not was_used:
                    continue  # no rank produced a gradient: leave .grad as plain PyTorch would
                lay = sp.layout
                shard = out[: lay.local_numel].view(lay.local_shape)
                # blocking: an asynchronous device-to-host copy could still be running when the
                # optimizer reads an offloaded gradient
                shard = shard.to(device=sp.user.device, dtype=sp.dtype)
                if sp.user.grad is None:
                    sp.user.grad = shard  # a view of ``out``, which nothing else reuses
                else:
                    sp.user.grad.add_(shard)


def used_flags(used: list[bool], repeats: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``used`` as 1/0 values, repeated ``repeats`` times, made on ``device`` without a host-to-device copy
    (a copy from pageable host memory would wait for the device's queue: no overlap in backward).
    One fill in the common case where every flag is 1; one more per unused parameter."""
    flags = torch.ones(repeats, len(used), dtype=dtype, device=device)
    for i, was_used in enumerate(used):
        if not was_used:
            flags[:, i].zero_()
    return flags.view(-1)


def _reduce_input(grad: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reduce-scatter input for one full gradient: the gradient itself when it already is
    ``numel`` contiguous elements of ``dtype`` on ``device``, else a zero-padded copy."""
    if grad is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    if grad.numel() == numel and grad.dtype == dtype and grad.device == device and grad.is_contiguous():
        return grad.view(-1)
    buf = torch.empty(numel, dtype=dtype, device=device)
    buf[: grad.numel()].copy_(grad.reshape(-1))
    buf[grad.numel():].zero_()
    return buf


@dataclass
class _PendingGroup:
    """One reduce-scatter of parameters sharing a reduce dtype, and its buffers until it completes."""

    params: list[ShardedParam]
    handle: Handle
    outs: list[torch.Tensor]  # one reduced shard per parameter, then the flags
    inputs: list[torch.Tensor]  # kept alive until the collective is done with them
    all_used_here: bool  # every parameter had a gradient on this rank: no need to read the flags
    flat: torch.Tensor  # the buffer ``outs`` are views of


@dataclass
class PendingReduce:
    """A unit's gradient reduce in flight (one reduce-scatter per reduce dtype, then, with several
    replicas, one all-reduce of its result across them)."""

    unit: Unit
    groups: list[_PendingGroup]
    inter_launched: bool = False

    def launch_inter(self) -> None:
        """Wait for the reduce-scatters and start the all-reduce across replicas (no-op without them)."""
        replicas = self.unit.rt.replicas
        if self.inter_launched or replicas is None:
            return
        self.inter_launched = True
        for group in self.groups:
            group.handle.wait()
            group.handle = replicas.all_reduce(group.flat, op="avg", async_op=True,
                                               tag=f"all-reduce across replicas of unit {self.unit.name}")

    def finish(self) -> None:
        self.launch_inter()
        for group in self.groups:
            group.handle.wait()
            self.unit.rt.fence([group.flat])
            n = len(group.params)
            used = [True] * n if group.all_used_here else (group.outs[n] > 0).tolist()
            self.unit.accumulate_grads(group.params, group.outs[:n], used)


def plan_buffer(segs: list[int], dtypes: list[torch.dtype]) -> tuple[torch.dtype, FlatLayout]:
    """The dtype and layout of one flat buffer holding segments of ``segs`` elements of ``dtypes``.

    One dtype: a buffer of that dtype. Mixed dtypes (fp32 norms beside bf16 weights): a byte buffer
    whose segments are aligned so that each can be viewed as its own dtype.
    """
    kinds = set(dtypes)
    if len(kinds) <= 1:
        return (next(iter(kinds)) if kinds else torch.float32), FlatLayout.of(segs)
    sizes = [n * torch.empty((), dtype=d).element_size() for n, d in zip(segs, dtypes, strict=True)]
    return torch.uint8, FlatLayout.of(sizes, align=_BYTE_ALIGN)


_BYTE_ALIGN = 16  # alignment of segments in a mixed-dtype (byte) buffer


def segment(flat_or_grid: torch.Tensor, layout: FlatLayout, i: int, dtype: torch.dtype) -> torch.Tensor:
    """Segment ``i`` of a flat buffer (1-D) or of an all-gather output viewed ``(world_size, row)``."""
    off, size = layout.offsets[i], layout.sizes[i]
    seg = flat_or_grid[..., off:off + size]
    return seg.view(dtype) if flat_or_grid.dtype == torch.uint8 and dtype != torch.uint8 else seg
