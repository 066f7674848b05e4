"""When units gather, run, reduce and free (stages 1-3): module hooks, autograd hooks, prefetch.

Forward: a unit's forward pre-hook waits for (or issues) its all-gather, optionally prefetches the
next units in the previous forward's order, swaps the full parameters in and routes the unit's
grad-requiring inputs through ``_PostBackward``; its forward hook swaps the user's Parameters back,
frees the full parameters at stage 3 (except the root unit's while gradients are on: its
parameters are needed first in backward, as in PyTorch FSDP2) and hooks the outputs' gradients.

Backward: the first gradient reaching a unit's outputs ("pre-backward") gathers the unit again and
prefetches the next units in reverse forward order; ``_PostBackward`` fires once autograd has
produced the gradients of the unit's inputs, which comes after its parameters' gradients
(AccumulateGrad runs first in the engine's ready queue), so the unit's gradients are complete:
it is reduce-scattered asynchronously (stages 2-3) and freed. A callback queued on the autograd
engine finishes what did not fire (units without grad-requiring inputs, the root), waits for the
reduce-scatters, and writes each rank's gradient shard into ``param.grad``. Stage 1 reduces every
unit in that callback (gradients reduced once at the end of backward). Stage 0 runs here only with
compute copies in another dtype (param_dtype): units are not sharded and each unit's gradients
are all-reduced when its backward is done (the unit is the bucket).

Collectives are issued in the same order on every rank because every decision here depends only
on the (shared) module structure and execution order.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

import torch
from torch.autograd import Variable

from .options import ShardingOptions
from .trees import cast_floating, replace_grad_tensors, tensors_in
from .unit import GATHERING, SHARDED, PendingReduce, Unit

_MAX_REDUCES_IN_FLIGHT = 2


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the engine the unit's gradients are done."""

    @staticmethod
    def forward(ctx, callback, *tensors):  # type: ignore[override]
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


class ShardEngine:
    """Drives the units of one model through forward and backward."""

    def __init__(self, units: list[Unit], options: ShardingOptions) -> None:
        self.units = units
        self.root = units[0]
        self.options = options
        self.stage = int(options.stage)
        self.sync = True  # False inside no_sync(): keep full gradients, no reduce
        self.order: list[Unit] = []  # non-root units in the last forward's order
        self._recording: list[Unit] = []
        self._reduces: deque[PendingReduce] = deque()
        self._callback_queued = False
        self.prefetched = 0  # all-gathers issued ahead of need
        self.peak_in_flight = 0  # most units gathered or gathering at once (non-root at stage 3)
        self._hooks: list[Any] = []
        for unit in units:
            self._hooks.append(unit.module.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ prefetch
    def _inflight(self) -> int:
        if self.stage == 3:
            return sum(1 for u in self.units if not u.is_root and u.state != SHARDED)
        return sum(1 for u in self.units if u.state == GATHERING)

    def _prefetch(self, candidates: list[Unit]) -> None:
        for unit in candidates:
            if self._inflight() >= self.options.max_inflight_all_gathers:
                return
            if unit.state != GATHERING and unit.needs_gather() and not unit.backward_done:
                unit.start_gather()
                self.prefetched += 1
                self._note_in_flight()

    def _note_in_flight(self) -> None:
        self.peak_in_flight = max(self.peak_in_flight, self._inflight())

    def _after(self, unit: Unit, order: list[Unit]) -> list[Unit]:
        if unit.is_root:
            return list(order)
        try:
            return order[order.index(unit) + 1:]
        except ValueError:
            return []

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, unit: Unit, module, args, kwargs):
        if unit.in_backward:
            # a recompute inside this unit's backward (checkpointing that re-enters module.__call__,
            # e.g. Hugging Face's gradient_checkpointing_enable): parameters are gathered and must stay so
            unit.wait_gather()
            unit.swap_in()
            return None
        if unit.is_root:
            self._recording = []
        elif unit not in self._recording:
            self._recording.append(unit)
        unit.wait_gather()
        self._note_in_flight()
        if self.options.forward_prefetch or self.stage < 3:
            self._prefetch(self._after(unit, self.order))
        unit.swap_in()
        dtype = self.options.param_dtype
        args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
        if torch.is_grad_enabled():
            unit.pending_backward_calls += 1
            callback = functools.partial(self._post_backward, unit)
            args, kwargs = replace_grad_tensors((args, kwargs), lambda ts: _PostBackward.apply(callback, *ts))
        return args, kwargs

    def _post_forward(self, unit: Unit, module, args, output):
        if unit.in_backward:
            return None
        unit.swap_out()
        if unit.is_root and self._recording:
            self.order = self._recording
        grad_outputs = [t for t in tensors_in(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if self.stage == 3 and not (unit.is_root and grad_outputs):
            unit.reshard()  # the root stays gathered only if a backward can follow
            if unit.is_root:  # no backward: free units prefetched but never run, too
                for other in self.units:
                    other.reshard()
        hook = functools.partial(self._pre_backward, unit)
        for t in grad_outputs:
            t.register_hook(hook)
        return output

    # ------------------------------------------------------------------ backward
    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._queue_final_callback()
        if unit.backward_done:
            return
        unit.in_backward = True
        unit.wait_gather()
        self._note_in_flight()
        unit.swap_in()  # activation-checkpointing recompute reads the module's parameters
        if self.options.backward_prefetch == "pre":
            self._prefetch(self._after(unit, self.order[::-1]))

    def _post_backward(self, unit: Unit) -> None:
        unit.pending_backward_calls -= 1
        if unit.pending_backward_calls <= 0:
            self._unit_backward_done(unit)

    def _unit_backward_done(self, unit: Unit) -> None:
        if unit.backward_done:
            return
        unit.backward_done = True
        unit.in_backward = False
        unit.swap_out()
        if self.sync and self.stage != 1:
            self._reduce(unit)
        if self.stage == 3:
            unit.reshard()
        if self.options.backward_prefetch == "post":
            self._prefetch(self._after(unit, self.order[::-1]))

    def _reduce(self, unit: Unit) -> None:
        while len(self._reduces) >= _MAX_REDUCES_IN_FLIGHT:
            self._reduces.popleft().finish()
        pending = unit.start_reduce()
        if pending is not None:
            self._reduces.append(pending)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for unit in reversed(self.units):  # fixed order: the same collectives on every rank
            self._unit_backward_done(unit)
        if self.sync and self.stage == 1:
            for unit in reversed(self.units):
                self._reduce(unit)
        self.drain()
        for unit in self.units:
            unit.backward_done = unit.in_backward = False
            unit.pending_backward_calls = 0

    def drain(self) -> None:
        """Wait for every reduce-scatter in flight and write the gradient shards."""
        while self._reduces:
            self._reduces.popleft().finish()
