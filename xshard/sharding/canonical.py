"""The canonical order: the one order every rank issues its units' collectives in, whatever its forward ran.

Ranks whose batches take different branches (an image tower that text-only batches skip, experts that get no
tokens on a rank, a head used on some steps) run different units. A unit's all-gather and reduce-scatter are
collectives of every rank, so a rank that skips a unit still has to take part in them, at the same point of
its sequence as the ranks that run it. No message says where that point is: it follows from an order every
rank knows, this one, and from where each rank is in it.

Forward: when a rank reaches a unit, the units before it in the canonical order that it has not reached in
this forward are *passed* first: the engine does for each what the unit's own hooks would do (gather it,
prefetch after it, free it), with no computation. At the end of the root's forward the units after the last
one reached are passed. A rank that runs every unit in the canonical order passes none: no cost.

Backward: only units this rank skipped in forward are passed (a unit it ran has an autograd graph, and its
own hooks fire: passing it would reduce a gradient still to come). They are passed when backward reaches a
unit after them in the reverse canonical order, or at its end: gathered as the ranks that ran them gather
them (when they have trainable parameters, or follow a unit that has: their outputs then carry gradients),
and reduced with zeros, whose "no gradient here" flags ride in the reduce itself (``reduce.py``).

The order starts as the units' registration order (the plan's: a model's modules are registered in the order
most models run them). A rank whose forward reaches units in another order (CLIP runs its vision tower, the
second registered, first) learns the order it saw: ranks that run the same units in the same order learn the
same order in the same step, so they keep agreeing. What this cannot reconcile (a model whose order truly
differs between ranks, a unit called a different number of times on different ranks) makes the ranks' collective
sequences differ; the collective monitor names that within seconds (``backends/diagnostics/monitor.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .unit import Unit

log = logging.getLogger("xshard.sharding")


class CanonicalOrder:
    """The non-root units in the order their collectives are issued, and where this rank is in it."""

    def __init__(self, units: Sequence[Unit], peers: bool = True) -> None:
        self.units: list[Unit] = list(units)
        #: other ranks take part in the units' collectives (one process alone passes nothing)
        self.peers = peers
        self._index()
        # forward: the next canonical position not yet reached or passed, the units this forward reached
        self._next = 0
        self._reached: set[Unit] = set()
        self._in_forward = False
        # units run outside the root's forward (an encoder that generate() calls once, before its decoding
        # steps' forwards skip it on every rank): not passed in the root's forwards that follow
        self._outside: set[Unit] = set()
        # since the last backward: units passed in a forward with gradients on, units run in one
        self._passed: set[Unit] = set()
        self._ran: set[Unit] = set()
        # backward: the next reverse-canonical position, the skipped units still to pass
        self._next_back = 0
        self._to_pass: set[Unit] | None = None
        #: units passed (forward and backward) since the job started: the cost of ranks on different paths
        self.passes = 0

    def _index(self) -> None:
        self.position = {unit: i for i, unit in enumerate(self.units)}
        self.reverse = self.units[::-1]
        self.reverse_position = {unit: i for i, unit in enumerate(self.reverse)}
        # a unit with trainable parameters before it carries gradients through its outputs even when frozen
        self._grad_upstream: dict[Unit, bool] | None = None

    # ------------------------------------------------------------------ forward
    @property
    def in_forward(self) -> bool:
        """Inside the root's forward (units reached outside it, e.g. an encoder called by generate(), are not
        placed in the order)."""
        return self._in_forward

    def begin_forward(self, grad: bool) -> None:
        """The root's forward begins. Without gradients (generation) the units of the call outside it just
        before count as reached; a training forward passes whatever it skips."""
        self._next, self._reached, self._in_forward = 0, set() if grad else set(self._outside), True

    def begin_outside_call(self) -> None:
        """A call of part of the model outside the root's forward begins (``get_encoder()(...)``)."""
        self._outside = set()

    def reach_outside(self, unit: Unit, grad: bool) -> None:
        """``unit`` runs in a call outside the root's forward (no unit is passed there)."""
        self._outside.add(unit)
        if grad:
            self._ran.add(unit)

    def reach(self, unit: Unit, grad: bool) -> list[Unit]:
        """``unit``'s forward begins: the units to pass before it (skipped by this rank, before it in the order)."""
        self._reached.add(unit)
        if grad:
            self._ran.add(unit)
        at = self.position[unit]
        if at < self._next:  # a second call, or an order the canonical one does not know yet (see learn)
            return []
        skipped = [u for u in self.units[self._next:at] if u not in self._reached]
        self._next = at + 1
        return self._note_passed(skipped, grad)

    def end_forward(self, grad: bool) -> list[Unit]:
        """The root's forward ends: the units after the last one reached, to pass."""
        skipped = [u for u in self.units[self._next:] if u not in self._reached]
        self._next, self._in_forward = len(self.units), False
        return self._note_passed(skipped, grad)

    def _note_passed(self, skipped: list[Unit], grad: bool) -> list[Unit]:
        if not self.peers:
            return []
        self.passes += len(skipped)
        if grad:
            self._passed.update(skipped)
        return skipped

    def learn(self, reached: list[Unit]) -> bool:
        """After a forward that reached ``reached`` (first reach order): adopt it where it contradicts the
        order; True if the order changed. Units it did not reach keep their place before the next unit that
        followed them. A rank that only skipped units keeps the order."""
        at = [self.position[u] for u in reached]
        if all(a < b for a, b in zip(at, at[1:], strict=False)):
            return False
        seen = {u: i for i, u in enumerate(reached)}
        keys: dict[Unit, tuple[float, int]] = {}
        follow = float(len(reached))
        for i in range(len(self.units) - 1, -1, -1):  # each unreached unit goes before the next reached one
            u = self.units[i]
            if u in seen:
                follow = seen[u]
                keys[u] = (follow, 1)
            else:
                keys[u] = (follow, 0)
        old = [u.name for u in self.units]
        self.units.sort(key=lambda u: (keys[u], self.position[u]))
        self._index()
        log.info("the units run in another order than they are registered in; their collectives now follow the "
                 "order this forward ran them in (was %s, now %s)", old[:8], [u.name for u in self.units][:8])
        return True

    # ------------------------------------------------------------------ backward
    def reach_backward(self, unit: Unit) -> list[Unit]:
        """``unit``'s backward begins: the skipped units before it in the reverse order, to pass."""
        pending = self._backward_pending()
        at = self.reverse_position.get(unit)
        if at is None or at < self._next_back:
            return []
        skipped = [u for u in self.reverse[self._next_back:at] if u in pending]
        self._next_back = at + 1
        pending.difference_update(skipped)
        self.passes += len(skipped)
        return skipped

    def end_backward(self) -> list[Unit]:
        """Backward ends: the skipped units still to pass (then the next backward starts afresh)."""
        pending = self._backward_pending()
        skipped = [u for u in self.reverse[self._next_back:] if u in pending]
        self.passes += len(skipped)
        self._next_back, self._to_pass, self._grad_upstream = 0, None, None
        self._passed, self._ran, self._outside = set(), set(), set()
        return skipped

    def _backward_pending(self) -> set[Unit]:
        if self._to_pass is None:
            self._to_pass = self._passed - self._ran
        return self._to_pass

    def gathered_in_backward(self, unit: Unit) -> bool:
        """Do the ranks that ran ``unit`` gather it in backward? Yes when its outputs carry gradients, which a
        rank that skipped it judges by the parameters: its own trainable ones, or a unit's before it."""
        if self._grad_upstream is None:
            self._grad_upstream, upstream = {}, False
            for u in self.units:
                upstream = upstream or bool(u.trainable)
                self._grad_upstream[u] = upstream
        return self._grad_upstream[unit]
