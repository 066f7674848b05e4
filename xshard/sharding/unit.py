"""A unit at run time: its parameters' shards and full copies, one all-gather and one reduce per step.

A unit is gathered and reduced as one collective operation each. Its state is explicit:

    SHARDED --start_gather--> GATHERING --wait_gather--> GATHERED --reshard--> SHARDED

A gathered copy is never older than its shard: every gather records the shards' version counters
(and the optimizer's step hook marks units stale), and ``wait_gather`` gathers again when a shard
changed after the gather was issued, e.g. a unit prefetched in a step where it did not run and
updated by the optimizer before its next use.

Gradients: ``reduce.py`` (the reduce-scatter of each unit, its flags, hybrid sharding's all-reduce).

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

    from .reduce_group import ReduceGroup


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


class UnitCounts:
    """How many units of one model are in each state, kept as the states change (``Unit.state``).

    The engine asks these at every prefetch decision; counting them by walking the units cost
    O(units) per question, O(units^2) per step.
    """

    __slots__ = ("gathering", "held")

    def __init__(self) -> None:
        self.gathering = 0  # units with an all-gather in flight
        self.held = 0  # non-root units whose full copies are gathering or gathered


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
    #: the units' states, counted (see UnitCounts)
    counts: UnitCounts = field(default_factory=UnitCounts)


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
        self._state = UnitState.SHARDED
        self._users = [sp.user for sp in self.params]  # the shard-holding Parameters (fixed for the unit's life)
        self.state = UnitState.GATHERED if resident else UnitState.SHARDED
        self.stamp: tuple[int, ...] | None = self.versions() if resident else None
        # True when the full copies may not match the shards: resident copies start from this rank's
        # own values, so the first forward gathers (ranks agree even without sync_module_states);
        # also set by the optimizer's step hook and by writes behind the version counters
        self.stale = resident
        self._pending: tuple[Handle, list[torch.Tensor]] | None = None  # (handle, targets) while GATHERING
        #: the all-gathers' (outputs, inputs) by "from post-forward pieces" (see _gather_views)
        self._views: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        #: (module, attribute, full copy, user's Parameter) for every place a parameter is registered
        self._places = [(module, attr, sp.full, sp.user) for sp in self.params for module, attr in sp.spec.places]
        #: the shards' versions when the post-forward pieces were cut (None: no pieces held)
        self._post_stamp: tuple[int, ...] | None = None
        self.backward = BackwardState.IDLE
        self.pending_backward_calls = 0
        #: the full copies are registered in the modules (between ``swap_in`` and ``swap_out``)
        self.swapped = False
        self.trainable: list[ShardedParam] = []
        #: reduce.reduce_groups' groups, with the ``trainable`` list they were built from
        self.reduce_cache: tuple[list[ShardedParam], list[ReduceGroup]] | None = None
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

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> UnitState:
        """Where this unit's full copies are (setting it keeps ``rt.counts`` up to date)."""
        return self._state

    @state.setter
    def state(self, new: UnitState) -> None:
        old, self._state = self._state, new
        counts = self.rt.counts
        counts.gathering += (new is UnitState.GATHERING) - (old is UnitState.GATHERING)
        if not self.is_root:
            counts.held += (new is not UnitState.SHARDED) - (old is not UnitState.SHARDED)

    def versions(self) -> tuple[int, ...]:
        """The shards' version counters (see ``ShardedParam.version``), read now."""
        return tuple([user._version for user in self._users])

    def is_current(self) -> bool:
        """Do the gathered full copies hold the shards' current values?"""
        return self._state is UnitState.GATHERED and not self.stale and self.stamp == self.versions()

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
        if not self.params or self._state is UnitState.GATHERING or self.is_current():
            return False
        rt = self.rt
        from_pieces = self._post_forward_current()
        collectives = rt.post_forward if from_pieces else rt.collectives
        assert collectives is not None  # pieces are kept only where there is a post-forward group
        # current pieces exist for every parameter (``_post_forward_current``)
        sources = cast("list[torch.Tensor]", [sp.post_forward if from_pieces else sp.padded for sp in self.params])
        rt.fence(sources + list(after))
        with torch.no_grad():
            if rt.frees_storage_by_resize:  # gathered in place, into the full copies' storages
                for sp in self.params:
                    self._alloc(sp)
                targets, inputs = self._gather_views(from_pieces)
                torch._foreach_copy_(inputs, sources, non_blocking=True)
            else:  # each full copy takes a fresh target's data once the gather is done
                targets, inputs = [], []
                for sp, source in zip(self.params, sources, strict=True):
                    lay = sp.post_layout if from_pieces else sp.layout
                    assert lay is not None  # a current piece has its layout
                    targets.append(torch.empty(lay.gather_numel, dtype=sp.gather_dtype, device=rt.device))
                    inputs.append(source.to(device=rt.device, dtype=sp.gather_dtype))
        what = "post-forward pieces of unit" if from_pieces else "unit"
        handle = collectives.all_gather_into_tensors(targets, inputs, async_op=True, tag=f"all-gather of {what} {self.name}")
        self._drop_post_forward()
        self._pending = (handle, targets)
        self.stamp = self.versions()
        self.stale = False
        self.state = UnitState.GATHERING
        return True

    def _gather_views(self, from_pieces: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The all-gather's outputs (each full copy's storage seen flat) and inputs (this rank's slice of
        each), for a gather over the shard group or, ``from_pieces``, the post-forward group, where full
        copies are freed by resizing (called with the storages allocated: a view is cut within bounds).

        Built once per unit and group: they are views of storages that live as long as the unit (freed
        by resizing them to 0, or by moving their memory to the pool, and refilled in place), so the
        same view objects are valid at every gather and nothing invalidates them.
        """
        cached = self._views.get(from_pieces)
        if cached is None:
            targets, inputs = [], []
            for sp in self.params:
                lay = sp.post_layout if from_pieces else sp.layout
                assert lay is not None and sp.gather_target is not None  # pieces only with a post-forward group
                target = sp.gather_target[: lay.gather_numel]
                targets.append(target)
                inputs.append(target[lay.rank * lay.seg:(lay.rank + 1) * lay.seg])
            cached = self._views[from_pieces] = (targets, inputs)
        return cached

    def finish_gather(self) -> None:
        """Complete an in-flight gather (nothing else): the copies are as of when it was issued."""
        if self._state is not UnitState.GATHERING or self._pending is None:
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
        if self._state is UnitState.SHARDED:
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
        if sp.storage is not None and self.rt.pool is not None:
            self.rt.pool.free(sp.storage)
        elif sp.storage is not None:
            sp.storage.resize_(0)
        else:  # devices without resizable storage (XLA): drop the data, keep the Parameter object
            sp.full.data = torch.empty(0, dtype=sp.gather_dtype, device=self.rt.device)

    def _alloc(self, sp: ShardedParam) -> None:
        storage = sp.storage
        assert storage is not None  # only where full copies are freed by resizing
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
        """Register the full copies wherever the model registers the unit's parameters."""
        for module, attr, full, _ in self._places:
            module._parameters[attr] = full
        self.swapped = True

    def swap_out(self) -> None:
        """Register the user's Parameters again."""
        for module, attr, _, user in self._places:
            module._parameters[attr] = user
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
