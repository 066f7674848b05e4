"""The gradient reduce of stages 1-3: each unit's gradients averaged over ranks, each rank keeping its shard.

One unit, one reduce per reduce dtype (``start_reduce``): each trainable parameter's full gradient is
reduce-scattered with ``op="avg"``. Parameters that got no gradient on a rank contribute zeros, and a flag per
parameter travels in the same collective, so after the reduce each rank knows whether any rank produced a
gradient: a parameter used on no rank keeps ``grad is None`` (AdamW's decay and momentum then leave it alone,
as in plain PyTorch and DDP); one used on some ranks gets the average, as in DDP. The flags are read on the
host only when this rank lacked a gradient (a rank whose batch skipped a unit, or a parameter its forward did
not use), so a step in which every rank used every parameter reads none.

Hybrid sharding: ``rt.collectives`` is the shard group, so reduce-scatters stay inside it; the reduced shards
(and the flags) of one reduce lie in one flat buffer, which is then averaged across the replica group
(``rt.replicas``) with one all-reduce. That all-reduce can only start once the reduce-scatter is done:
``PendingReduce.launch_inter`` starts it, and ``ReducePipeline`` calls it for the earlier units while a later
unit's reduce-scatter is in flight.

``ReducePipeline`` keeps at most ``MAX_IN_FLIGHT`` reduces in flight (each holds its unit's packed gradients)
and writes the shards into ``param.grad`` as each completes (``accumulate_grads``: added to what an earlier
accumulation window left there).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .reduce_group import ReduceGroup

if TYPE_CHECKING:  # types only: the core imports nothing of the device layer at run time
    from xshard.backends import Handle

    from .params import ShardedParam
    from .unit import Unit

#: reduces in flight at once (each holds its unit's packed gradients until it completes)
MAX_IN_FLIGHT = 2


def reduce_groups(unit: Unit) -> list[ReduceGroup]:
    """``unit``'s trainable parameters grouped by the dtype their gradients are reduced in.

    Cached on the unit with the list of trainable parameters it was built from: ``refresh_trainable``
    replaces that list whenever ``requires_grad`` changes, and nothing else changes a group (the
    precision and the layouts are fixed), so the identity check is the whole invalidation.
    """
    cached = unit.reduce_cache
    if cached is not None and cached[0] is unit.trainable:
        return cached[1]
    precision = unit.rt.plan.precision
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for sp in unit.trainable:
        dtype = precision.reduce_dtype or precision.param_dtype or sp.gather_dtype
        by_dtype.setdefault(dtype, []).append(sp)
    groups = []
    for dtype, sps in by_dtype.items():
        sizes = [sp.layout.seg for sp in sps] + [len(sps)]
        groups.append(ReduceGroup(dtype, sps, [sp.layout.gather_numel for sp in sps], sizes, sum(sizes)))
    unit.reduce_cache = (unit.trainable, groups)
    return groups


def start_reduce(unit: Unit) -> PendingReduce | None:
    """Hand ``unit``'s full gradients to the reduce-scatter (asynchronous) and drop them from the full copies.

    A gradient already in the reduce dtype, contiguous and of ``world_size`` whole shards is the reduce's input
    itself (the collectives may reduce it in place): no packing buffer. Only padded or cast gradients are
    copied, into a zero-padded buffer of their own.
    """
    if not unit.trainable:
        return None
    rt = unit.rt
    world = rt.collectives.world_size
    groups = []
    with torch.no_grad():
        for group in reduce_groups(unit):
            dtype, sps = group.dtype, group.params
            grads = [sp.full.grad for sp in sps]
            used = [g is not None for g in grads]
            inputs = [_reduce_input(g, n, dtype, rt.device) for g, n in zip(grads, group.numels, strict=True)]
            # the reduced shards and the flags: views of one buffer (the replicas' all-reduce takes it whole)
            flat = torch.empty(group.total, dtype=dtype, device=rt.device)
            outputs = list(flat.split(group.sizes))
            for sp in sps:
                sp.full.grad = None
            # one flag per parameter, repeated for every rank's slice: each rank receives the
            # average over ranks of "had a gradient" (> 0: some rank used it)
            inputs.append(used_flags(used, world, dtype, rt.device))
            rt.fence(inputs)
            handle = rt.collectives.reduce_scatter_tensors(
                outputs, inputs, op="avg", async_op=True, tag=f"reduce-scatter of unit {unit.name}")
            groups.append(_PendingGroup(sps, handle, outputs, inputs, all(used), flat))
    return PendingReduce(unit, groups)


def accumulate_grads(sps: list[ShardedParam], outs: list[torch.Tensor], used: list[bool]) -> None:
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
        """Wait for the reduce and write this rank's gradient shards."""
        self.launch_inter()
        for group in self.groups:
            group.handle.wait()
            self.unit.rt.fence([group.flat])
            n = len(group.params)
            used = [True] * n if group.all_used_here else (group.outs[n] > 0).tolist()
            accumulate_grads(group.params, group.outs[:n], used)


class ReducePipeline:
    """The reduces of one backward in flight, at most ``MAX_IN_FLIGHT`` at once, in the order they were issued."""

    def __init__(self) -> None:
        self._in_flight: deque[PendingReduce] = deque()

    def reduce(self, unit: Unit) -> None:
        """Start ``unit``'s reduce (finishing the oldest first when the pipeline is full)."""
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._in_flight.popleft().finish()
        pending = start_reduce(unit)
        # hybrid sharding: the earlier units' reduce-scatters were issued a unit ago; hand them to the
        # all-reduce across replicas while this unit's reduce-scatter runs (a no-op with one replica)
        for earlier in self._in_flight:
            earlier.launch_inter()
        if pending is not None:
            self._in_flight.append(pending)

    def drain(self) -> None:
        """Wait for every reduce in flight and write the gradient shards."""
        while self._in_flight:
            self._in_flight.popleft().finish()
