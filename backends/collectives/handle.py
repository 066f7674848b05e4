"""``Handle``: a collective in flight, waited on once; ``IN_FLIGHT``: how many this process handed out.

A wait that fails (a timeout, a peer that died mid-collective) is explained by the hang monitor
(``backends/diagnostics/monitor.py``) where the handle is watched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch

from ...errors import CollectiveMismatchError, CollectiveTimeoutError, RankDiedError
from ..diagnostics.flight_recorder import FlightEntry
from ..diagnostics.monitor import CollectiveMonitor

if TYPE_CHECKING:
    from torch.distributed import Work  # a process group's in-flight operation

#: what a finished collective hands back: its output tensor, the outputs of a list form, or None (a barrier)
Output: TypeAlias = "torch.Tensor | list[torch.Tensor] | None"


class InFlight:
    """How many async handles this process handed out and has not waited to completion (every
    ``Collectives`` object counts here). 0: no collective of this process is in flight, so its process
    group can be left without waiting for a peer (``CommunicationAPI.leave_at_exit``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._count += n

    @property
    def count(self) -> int:
        return self._count


IN_FLIGHT = InFlight()


class Handle:
    """An asynchronous collective in flight. ``wait()`` blocks until it is done and returns its output.

    ``finish`` runs once after the underlying work completes (e.g. the divide of a SUM-then-divide
    average, or the copy of this rank's slice out of an all-reduce).
    """

    __slots__ = ("_works", "_finish", "_output", "_done", "_monitor", "_label", "_counted", "_entry")

    def __init__(self, works: Sequence[Work | Handle | None], output: Output,
                 finish: Callable[[], object] | None = None) -> None:
        self._works = works
        self._finish = finish
        self._output = output
        self._done = False
        self._monitor: CollectiveMonitor | None = None
        self._label: tuple[int, str] = (0, "")
        #: counted in ``IN_FLIGHT`` until waited (async handles handed to a caller)
        self._counted = False
        #: this collective's flight-recorder entry (its wait's start and end are marked on it)
        self._entry: FlightEntry | None = None

    def watch(self, monitor: CollectiveMonitor | None, number: int, description: str,
              entry: FlightEntry | None = None) -> Handle:
        """Report waits on this handle to ``monitor`` as collective ``number`` (see ``backends.diagnostics.monitor``),
        and mark them on its flight-recorder ``entry``."""
        self._monitor, self._label, self._entry = monitor, (number, description), entry
        if self._done and entry is not None:  # finished as it was issued (a world of one)
            entry.wait_started = entry.ended = entry.issued
        return self

    def wait(self) -> Output:
        """Block until the work is done (then run ``finish`` once); the output, or None for a barrier."""
        if not self._done:
            monitor, entry = self._monitor, self._entry
            if entry is not None:
                entry.wait_started = time.time()
            if monitor is not None:
                monitor.waiting(*self._label)
            try:
                for w in self._works:
                    if w is not None:
                        w.wait()
            except RuntimeError as exc:  # a timeout, or a peer that died mid-collective
                if monitor is None:
                    raise
                reported = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if monitor.mismatch is not None:  # why this wait could not complete: the ranks' collectives differ
                    raise CollectiveMismatchError(f"{monitor.mismatch} (this rank then waited in collective "
                                                  f"#{self._label[0]}, {self._label[1]}; the process group "
                                                  f"reported: {reported})") from exc
                died, message = monitor.explain_failure(reported)
                kind = RankDiedError if died else CollectiveTimeoutError
                raise kind(f"{message} (the process group reported: {reported})") from exc
            finally:
                if monitor is not None:
                    monitor.done(*self._label)
            if entry is not None:
                entry.ended = time.time()
            if self._finish is not None:
                self._finish()
            # what the work held (an exchange's inbox, a packing buffer) is not needed any more
            self._works, self._finish = (), None
            self._done = True
            if self._counted:
                IN_FLIGHT.add(-1)
        return self._output

    @property
    def done(self) -> bool:
        """Has ``wait()`` completed?"""
        return self._done


def _finished(output: Output) -> Handle:
    h = Handle([], output)
    h._done = True
    return h
