"""Calls to the job's key-value store that give up: the hang diagnosis never waits on the store it diagnoses.

A TCPStore client whose server is cut off (a node lost, a link down) does not fail: its ``get`` waits for
the store's timeout, then for the answer to its cancel, which never comes; ``set`` and ``check`` wait for
their answer the same way. Measured on two network namespaces with the link taken down: a ``get`` was still
waiting 170 s later. So every store call of ``backends.diagnostics.monitor`` runs here: on one thread that serves them in
turn for the life of the store (``backends/call_thread.py`` says why not one a call), each waited for at most
``bound`` seconds. A call with no answer by then raises ``StoreUnreachable``, and so does every later call at
once while it is still out; once it returns (the link came back), calls go through again. A call that fails
(the store's process died: the connection was refused or reset) raises ``StoreFailed``, which says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..call_thread import Call, CallThread

T = TypeVar("T")


class StoreUnreachable(Exception):
    """The store gave no answer within the bound: its host is down or cut off from this one."""


class StoreFailed(Exception):
    """The store answered with an error (its process ended: the connection was refused or reset)."""


class BoundedStore:
    """``store`` (a c10d store) whose calls give up after ``bound`` seconds (see the module docstring)."""

    def __init__(self, store: Any, bound: float) -> None:
        self.store = store
        self.bound = float(bound)
        self._lock = threading.Lock()
        self._calls = CallThread("xshard-store-calls")
        #: the call that outlived its bound (None when none did since the last answer)
        self._out: Call | None = None

    @property
    def silent_for(self) -> float:
        """Seconds the call still out has waited for its answer (0.0 when none is out)."""
        out = self._out
        return time.monotonic() - out.started if out is not None and not out.done.is_set() else 0.0

    def run(self, work: Callable[[Any], T], bound: float | None = None) -> T:
        """``work(store)`` on the store's thread, waited for at most ``bound`` (default: ``self.bound``) seconds."""
        with self._lock:
            if self.silent_for:
                raise StoreUnreachable(f"no answer for {self.silent_for:.0f} s")
            if not self._calls.alive:
                raise StoreFailed("the store's calls were closed (the job is ending)")
            self._out = None
            call = self._calls.submit(lambda: work(self.store))
            if not call.done.wait(self.bound if bound is None else bound):
                self._out = call
                raise StoreUnreachable(f"no answer in {time.monotonic() - call.started:.0f} s")
            if call.error is not None:
                text = str(call.error)
                raise StoreFailed(text.splitlines()[0] if text else type(call.error).__name__) from call.error
            return call.value

    def close(self, seconds: float) -> None:
        """End the store's thread, waiting up to ``seconds`` for it (for the call still out, when one is)."""
        self._calls.close(seconds)
