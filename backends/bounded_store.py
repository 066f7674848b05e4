"""Calls to the job's key-value store that give up: the hang diagnosis never waits on the store it diagnoses.

A TCPStore client whose server is cut off (a node lost, a link down) does not fail: its ``get`` waits for
the store's timeout, then for the answer to its cancel, which never comes; ``set`` and ``check`` wait for
their answer the same way. Measured on two network namespaces with the link taken down: a ``get`` was still
waiting 170 s later. So every store call of ``backends.monitor`` runs here: on a daemon thread of its own,
waited for at most ``bound`` seconds. A call with no answer by then raises ``StoreUnreachable``, and so does
every later call at once while it is still out (one thread is left waiting in the store, not one a call);
once it returns (the link came back), calls go through again. A call that fails (the store's process died:
the connection was refused or reset) raises ``StoreFailed``, which says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

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
        self._out: threading.Thread | None = None
        self._out_since = 0.0

    @property
    def silent_for(self) -> float:
        """Seconds the call still out has waited for its answer (0.0 when none is out)."""
        out = self._out
        return time.monotonic() - self._out_since if out is not None and out.is_alive() else 0.0

    def run(self, work: Callable[[Any], T], bound: float | None = None) -> T:
        """``work(store)`` on a thread of its own, waited for at most ``bound`` (default: ``self.bound``) seconds."""
        with self._lock:
            if self._out is not None and self._out.is_alive():
                raise StoreUnreachable(f"no answer for {self.silent_for:.0f} s")
            self._out = None
            box: dict[str, Any] = {}

            def call() -> None:
                try:
                    box["value"] = work(self.store)
                except BaseException as exc:  # handed to the caller
                    box["error"] = exc

            thread = threading.Thread(target=call, name="xshard-store-call", daemon=True)
            started = time.monotonic()
            thread.start()
            thread.join(self.bound if bound is None else bound)
            if thread.is_alive():
                self._out, self._out_since = thread, started
                raise StoreUnreachable(f"no answer in {time.monotonic() - started:.0f} s")
            if "error" in box:
                raise StoreFailed(str(box["error"]).splitlines()[0] if str(box["error"]) else
                                  type(box["error"]).__name__) from box["error"]
            return box["value"]

    def join(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the call still out (stopping: see ``CollectiveMonitor.stop``)."""
        out = self._out
        if out is not None:
            out.join(seconds)
