"""ShardedEngine: when units gather, run, reduce and free, driven by module and autograd hooks.

Forward: a unit's forward pre-hook follows the user's ``requires_grad``, waits for (or issues) its
all-gather, prefetches the next units in the canonical order, swaps the full parameters in
and routes the unit's grad-requiring inputs through ``_PostBackward``; its forward hook swaps the
user's Parameters back, frees the full parameters when the plan reshards after forward (except the
root unit's while gradients are on: its parameters are needed first in backward, as in PyTorch
FSDP2) and hooks the outputs' gradients. A forward that no backward follows (evaluation) finishes
every gather it prefetched.

Backward: the first gradient reaching a unit's outputs ("pre-backward") gathers the unit again and
prefetches the next units in the reverse canonical order; ``_PostBackward`` fires once autograd has
produced the gradients of the unit's inputs, which comes after its parameters' gradients
(AccumulateGrad runs first in the engine's ready queue), so the unit's gradients are complete: it is
reduced (asynchronously) when the plan reduces as gradients are ready, and freed. A callback queued
on the autograd engine finishes what did not fire (units without grad-requiring inputs, the root,
units skipped in this step), in a fixed order, reduces every unit when the plan reduces at the end of
backward, waits for the reduces and writes each rank's gradient shard into ``param.grad``.

Off-forward calls: the root unit holds the parameters no other unit holds (embeddings, final norms, a
head), swapped in only while the root module runs. Every module that registers one of them, and every
module on the way to it from the root (an encoder, ``model.model``), gets a pre-hook of its own: called
outside the root's forward (``generate()`` calling the encoder, ``get_input_embeddings()(ids)``), it
gathers the root unit and swaps it in for the call, and the units inside gather themselves as usual;
afterwards the root is swapped out and, when no backward follows, every gather is settled as after an
evaluation forward. Inside the root's forward the hooks see the root swapped in and do nothing.

torch.compile: the hooks are ``torch.compiler.disable``d, so a compiled model (or compiled blocks)
runs them eagerly at graph breaks around each unit, and the compiled graphs see ordinary Parameters
(the full copies, the same objects every step, so no recompilation).

Ranks on different paths: every rank issues its units' collectives in one canonical order
(``canonical.py``), whatever its forward ran. A unit this rank skipped (a branch its batch did not take)
is *passed* where it comes in that order: the same calls its hooks would make (gather, prefetch,
free; in backward gather and reduce zeros), with no computation. Prefetching follows the canonical order
too. ``Collectives.verify_same_collectives`` (called before each optimizer step) turns ranks whose
sequences still differ (an order that truly differs between ranks) into a clear error instead of
silently mixed-up gradients.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd import Variable

from .canonical import CanonicalOrder
from .engine import Engine
from .options import ShardingOptions
from .plan import ReduceTiming, ShardingPlan
from .reduce import ReducePipeline
from .trees import cast_floating, replace_grad_tensors, tensors_in
from .unit import BackwardState, Unit


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the engine the unit's gradients are done."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.callback()
        return (None, *grads)


class ShardedEngine(Engine):
    """Drives the units of one model through forward and backward (stages 1-3)."""

    def __init__(self, units: list[Unit], plan: ShardingPlan, options: ShardingOptions) -> None:
        super().__init__()
        self.units = units
        self.root = units[0]
        self.plan = plan
        self.forward_prefetch = bool(options.forward_prefetch) or not plan.reshard_after_forward.frees
        self.backward_prefetch: str | None = options.backward_prefetch
        if self.root.rt.compiles_graphs:  # the compiler orders the fenced gathers (see Runtime.compiles_graphs)
            self.forward_prefetch, self.backward_prefetch = False, None
        self.max_inflight = int(options.max_inflight_all_gathers)
        self._frees = plan.reshard_after_forward.frees
        self._counts = self.root.rt.counts  # the units' states, counted as they change
        #: the order every rank issues the non-root units' collectives in (ranks on different paths)
        rt = self.root.rt
        self.canonical = CanonicalOrder(units[1:], peers=rt.collectives.world_size > 1 or rt.replicas is not None)
        self._recording: list[Unit] = []
        self._reduces = ReducePipeline()
        self._callback_queued = False
        self._summoned = False  # inside full_params_context: hooks stand aside
        #: the module whose off-forward call swapped the root unit in (see the module docstring)
        self._off_forward_owner: torch.nn.Module | None = None
        #: root parameters took part in a graph outside the root's forward: their gradients may arrive
        #: after the root's inputs' gradients, so the root is reduced at the end of backward
        self._root_reduced_last = False
        self._hooks: list[Any] = []
        # per unit, made once: the callbacks its hooks hand to autograd at every forward
        self._post_backward_of = {unit: functools.partial(self._post_backward, unit) for unit in units}
        self._pre_backward_of = {unit: functools.partial(self._pre_backward, unit) for unit in units}
        for unit in units:
            self._hooks.append(unit.module.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
        for module in modules_reaching(self.root.module, {id(m) for sp in self.root.params for m, _ in sp.spec.places}):
            self._hooks.append(module.register_forward_pre_hook(self._off_forward_pre, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._off_forward_post, always_call=True))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def shards_changed(self) -> None:
        for unit in self.units:
            unit.stale = True

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.drop_full_grads()

    def reset_counters(self) -> None:
        super().reset_counters()
        self.canonical.passes = 0

    def units_passed(self) -> int:
        return self.canonical.passes

    # ------------------------------------------------------------------ prefetch
    def _inflight(self) -> int:
        counts = self._counts
        return counts.held if self._frees else counts.gathering

    def _prefetch(self, candidates: Iterable[Unit]) -> None:
        for unit in candidates:
            if self._inflight() >= self.max_inflight:
                return
            if unit.backward is not BackwardState.DONE and unit.start_gather():
                self.prefetched += 1
                self._note_in_flight()

    def _note_in_flight(self) -> None:
        self.peak_in_flight = max(self.peak_in_flight, self._inflight())

    def _after(self, unit: Unit, order: list[Unit], position: dict[Unit, int]) -> Iterator[Unit]:
        """The units after ``unit`` in ``order`` (all of them after the root), ``position`` its index."""
        if unit.is_root:
            return iter(order)
        at = position.get(unit)
        return iter(()) if at is None else itertools.islice(order, at + 1, None)

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable
    def _pre_forward(self, unit: Unit, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._summoned:
            return None
        if unit.backward is BackwardState.RUNNING:
            # a recompute inside this unit's backward (checkpointing that re-enters module.__call__,
            # e.g. Hugging Face's gradient_checkpointing_enable): parameters are gathered and must stay so
            unit.wait_gather()
            unit.swap_in()
            return None
        if unit.is_root:
            self._recording = []
            self.canonical.begin_forward(torch.is_grad_enabled())
        else:
            if unit not in self._recording:
                self._recording.append(unit)
            if self.canonical.in_forward:
                for skipped in self.canonical.reach(unit, torch.is_grad_enabled()):
                    self._pass_forward(skipped)
            else:
                self.canonical.reach_outside(unit, torch.is_grad_enabled())
        self._gather_for_forward(unit, after=tensors_in((args, kwargs)))
        unit.swap_in()
        dtype = self.plan.precision.param_dtype
        args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
        if torch.is_grad_enabled():
            unit.pending_backward_calls += 1
            callback = self._post_backward_of[unit]
            args, kwargs = replace_grad_tensors((args, kwargs), lambda ts: _PostBackward.apply(callback, *ts))
        return args, kwargs

    def _gather_for_forward(self, unit: Unit, after: list[torch.Tensor] | tuple = ()) -> None:
        unit.refresh_trainable()
        unit.wait_gather(after=after)
        self._note_in_flight()
        if self.forward_prefetch:
            self._prefetch(self._after(unit, self.canonical.units, self.canonical.position))

    def _pass_forward(self, unit: Unit) -> None:
        """What ``unit``'s forward hooks do, for a unit this rank skips: its gather is every rank's collective."""
        self._gather_for_forward(unit)
        if self.plan.reshard_after_forward.frees:
            unit.reshard(keep_post_forward=torch.is_grad_enabled())

    @torch.compiler.disable
    def _post_forward(self, unit: Unit, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self._summoned or unit.backward is BackwardState.RUNNING:
            return None
        if unit.is_root and self.canonical.in_forward:  # the units after the last one reached are passed
            for skipped in self.canonical.end_forward(torch.is_grad_enabled()):
                self._pass_forward(skipped)
            if self._recording:
                self.canonical.learn(self._recording)
        unit.swap_out()
        outputs = tensors_in(output)
        grad_outputs = [t for t in outputs if t.requires_grad] if torch.is_grad_enabled() else []
        backward_follows = bool(grad_outputs)
        if self._frees and not (unit.is_root and backward_follows):
            # the root stays gathered only if a backward can follow; with reshard_after_forward=k a
            # unit keeps its post-forward piece for that backward
            unit.reshard(keep_post_forward=backward_follows, before=outputs)
        if unit.is_root and not backward_follows:
            self._settle_gathers()  # no backward: gathers prefetched for units that never ran end here
        hook = self._pre_backward_of[unit]
        for t in grad_outputs:
            t.register_hook(hook)
        return output

    # ------------------------------------------------------------------ off-forward calls
    @torch.compiler.disable
    def _off_forward_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                         ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        root = self.root
        if self._summoned or root.swapped:  # inside the root's forward (or backward), or all whole
            return None
        root.refresh_trainable()
        root.wait_gather(after=tensors_in((args, kwargs)))
        root.swap_in()
        self._off_forward_owner = module
        self.canonical.begin_outside_call()
        dtype = self.plan.precision.param_dtype
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    @torch.compiler.disable
    def _off_forward_post(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._off_forward_owner is not module:
            return
        self._off_forward_owner = None
        self.root.swap_out()
        grad_outputs = [t for t in tensors_in(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if grad_outputs:  # the root's gradients come back through these: it stays gathered for them
            self._root_reduced_last = True
            hook = self._pre_backward_of[self.root]
            for t in grad_outputs:
                t.register_hook(hook)
        else:
            self._settle_gathers()

    def _settle_gathers(self) -> None:
        """Complete every gather in flight (each collective must finish on every rank) and, when the
        plan reshards after forward, free what is gathered."""
        for unit in self.units:
            if self.plan.reshard_after_forward.frees:
                unit.reshard()
            else:
                unit.finish_gather()

    # ------------------------------------------------------------------ backward
    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    @torch.compiler.disable
    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._queue_final_callback()
        if unit.backward is not BackwardState.IDLE:
            return
        if not unit.is_root:
            for skipped in self.canonical.reach_backward(unit):
                self._pass_backward(skipped)
        self._gather_for_backward(unit)
        unit.swap_in()  # activation-checkpointing recompute reads the module's parameters

    def _gather_for_backward(self, unit: Unit) -> None:
        unit.backward = BackwardState.RUNNING
        unit.wait_gather()
        self._note_in_flight()
        if self.backward_prefetch == "pre":
            self._prefetch(self._after(unit, self.canonical.reverse, self.canonical.reverse_position))

    def _pass_backward(self, unit: Unit) -> None:
        """What ``unit``'s backward hooks do on the ranks that ran it, for a unit this rank skipped in
        forward: gathered as they gather it, reduced with no gradient (zeros and a "none here" flag)."""
        if self.canonical.gathered_in_backward(unit):
            self._gather_for_backward(unit)
        self._unit_backward_done(unit)

    @torch.compiler.disable
    def _post_backward(self, unit: Unit) -> None:
        unit.pending_backward_calls -= 1
        if unit.pending_backward_calls <= 0 and not (unit.is_root and self._root_reduced_last):
            self._unit_backward_done(unit)

    def _unit_backward_done(self, unit: Unit, prefetch: bool = True) -> None:
        if unit.backward is BackwardState.DONE:
            return
        unit.backward = BackwardState.DONE
        unit.swap_out()
        if self.sync and self.plan.reduce_timing is ReduceTiming.AS_READY:
            self._reduce(unit)
        if self.plan.reshard_after_forward.frees:
            unit.reshard()
        if prefetch and self.backward_prefetch == "post":
            self._prefetch(self._after(unit, self.canonical.reverse, self.canonical.reverse_position))

    def _reduce(self, unit: Unit) -> None:
        self._reduces.reduce(unit)

    @torch.compiler.disable
    def _finish_backward(self) -> None:
        self._callback_queued = False
        for skipped in self.canonical.end_backward():
            self._pass_backward(skipped)
        for unit in reversed(self.units):  # fixed order: the same collectives on every rank
            self._unit_backward_done(unit, prefetch=False)  # nothing left to overlap a gather with
        if self.sync and self.plan.reduce_timing is ReduceTiming.END_OF_BACKWARD:
            for unit in reversed(self.units):
                self._reduce(unit)
        self.drain()
        self._settle_gathers()
        for unit in self.units:
            unit.backward = BackwardState.IDLE
            unit.pending_backward_calls = 0
        self._root_reduced_last = False

    def drain(self) -> None:
        """Wait for every reduce in flight and write the gradient shards."""
        self._reduces.drain()

    # ------------------------------------------------------------------ whole parameters
    @contextlib.contextmanager
    def full_params_context(self, writeback: bool = False) -> Iterator[None]:
        """Every unit gathered and swapped in; forward runs with no collective (every rank must enter).

        Afterwards the units are marked stale (the full copies may have been changed: resident copies
        are gathered afresh); with ``writeback`` each rank first copies its rows' changes into its shards.
        """
        if self._summoned:
            yield
            return
        for unit in self.units:
            unit.refresh_trainable()
            unit.wait_gather()
        for unit in self.units:
            unit.swap_in()
        self._summoned = True
        try:
            yield
        finally:
            self._summoned = False
            for unit in self.units:
                unit.swap_out()
                if writeback:
                    unit.write_back()
                unit.stale = True
                if self.plan.reshard_after_forward.frees:
                    unit.reshard()


def modules_reaching(root: torch.nn.Module, targets: set[int]) -> list[torch.nn.Module]:
    """The modules below ``root`` that are, or contain, a module whose id is in ``targets``."""
    found: dict[int, torch.nn.Module] = {}
    seen: dict[int, bool] = {}

    def visit(module: torch.nn.Module) -> bool:
        if id(module) in seen:
            return seen[id(module)]
        seen[id(module)] = False
        hit = id(module) in targets
        for child in module.children():
            hit = visit(child) or hit
        seen[id(module)] = hit
        if hit and module is not root:
            found[id(module)] = module
        return hit

    visit(root)
    return list(found.values())
