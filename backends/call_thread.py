"""One long-lived thread that runs the calls handed to it, in turn: xshard's background work without a
thread started or ended while a job trains.

Why not a thread a call: a process that forks while another of its threads is being created or ends can
deadlock in the child on CPython up to 3.11 (the child waits for the interpreter's thread-list lock, which
the vanished thread held: CPython gh-112275, fixed in 3.12). Data loader workers are forked at every epoch,
so work that starts a thread about once a second (the hang diagnosis's store calls) or at each checkpoint
(an asynchronous save, often at an epoch's end, just before the next epoch forks its workers) races them.
One such hang was seen in this project's CI: a loader worker stuck in ``os.fork``. A ``CallThread`` is
started once, when the job (or its first asynchronous save) starts, and ends when the job does.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class Call:
    """One call handed to a ``CallThread``, and its outcome once ``done`` is set."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        #: ``time.monotonic()`` when the call was handed over
        self.started = time.monotonic()


class CallThread:
    """A daemon thread named ``name`` that runs each submitted call to its end, one at a time."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Does the thread still take calls (``close`` not called, or the call it was in not yet returned)?"""
        return self._thread.is_alive()

    def submit(self, work: Callable[[], Any]) -> Call:
        """Hand ``work`` to the thread; wait on the returned call's ``done`` for its outcome."""
        call = Call(work)
        self._calls.put(call)
        return call

    def close(self, seconds: float) -> None:
        """End the thread after the calls handed to it, waiting up to ``seconds`` for it."""
        self._calls.put(None)
        self._thread.join(seconds)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call.value = call.work()
            except BaseException as exc:  # handed to whoever waits on the call
                call.error = exc
            call.done.set()
