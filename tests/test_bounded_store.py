"""The hang diagnosis's store calls (``backends/diagnostics/bounded_store.py``): they give up after their bound, say why,
and recover; and no thread starts or ends while a job trains, so a data loader's fork cannot hang on
CPython <= 3.11's thread-list lock (gh-112275: a loader worker stuck in ``os.fork`` was seen in CI while the
monitor started a thread for each store call)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from xshard.backends.diagnostics.bounded_store import BoundedStore, StoreFailed, StoreUnreachable
from xshard.backends.diagnostics.monitor import CollectiveMonitor


class _GatedStore:
    """A store whose ``get`` waits until ``gate`` opens (a store cut off, then back)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()

    def get(self, key: str) -> bytes:
        self.gate.wait()
        return key.encode()


def test_a_call_gets_its_answer_and_an_error_names_the_stores_failure() -> None:
    store = BoundedStore(_GatedStore(), bound=2.0)
    assert store.run(lambda s: s.get("a")) == b"a"

    def refused(_store):
        raise RuntimeError("Connection refused\nat some C++ frame")

    with pytest.raises(StoreFailed, match="^Connection refused$"):
        store.run(refused)
    assert store.run(lambda s: s.get("b")) == b"b"  # a failed call leaves the store usable
    store.close(2.0)


def test_a_call_with_no_answer_gives_up_and_calls_go_through_once_it_returns() -> None:
    gated = _GatedStore()
    store = BoundedStore(gated, bound=0.3)
    gated.gate.clear()
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match="no answer in"):
        store.run(lambda s: s.get("a"))
    assert 0.3 <= time.monotonic() - start < 2.0
    assert store.silent_for > 0.0
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match="no answer for"):  # at once while the first call is out
        store.run(lambda s: s.get("b"))
    assert time.monotonic() - start < 0.2
    gated.gate.set()  # the link is back
    deadline = time.monotonic() + 5
    while store.silent_for and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.run(lambda s: s.get("c")) == b"c"
    store.close(2.0)


def test_no_thread_starts_or_ends_while_the_monitor_publishes(monkeypatch) -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monitor = CollectiveMonitor(server, rank=0, world_size=1, timeout=30.0, interval=0.02)
    try:
        started: list[str] = []
        real_start = threading.Thread.start

        def counting_start(thread: threading.Thread) -> None:
            started.append(thread.name)
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", counting_start)
        before = {t.ident for t in threading.enumerate()}
        for number in range(1, 30):  # collectives come and go: each changed state is published
            monitor.waiting(number, "all_reduce")
            time.sleep(0.01)
            monitor.done(number, "all_reduce")
            time.sleep(0.01)
        published = server.get("xshard/progress/0").decode()
        assert '"number": ' in published and '"number": 0' not in published  # it did publish, as it went
        assert started == []
        assert {t.ident for t in threading.enumerate()} == before
    finally:
        monitor.stop()
