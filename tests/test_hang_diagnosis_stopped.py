"""A rank whose process is stopped (SIGSTOP, a debugger) is named stopped by the rank that waits for it,
wherever its published progress says it is: a rank held inside the collective, after its main thread
published the wait, blocks it as surely as one that never came (seen as "waiting in it as well" before).

The monitor of rank 0 reads rank 1's entry from a real store; rank 1 is a real process of this host,
stopped by SIGSTOP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from xshard.backends.diagnostics.monitor import CollectiveMonitor


@pytest.fixture
def stopped_pid():
    """A process of this host, stopped by SIGSTOP (killed at the end)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the kernel marks it stopped a moment after the signal
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    break
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's state from /proc")
@pytest.mark.parametrize("where", ["behind", "waiting in it", "ahead"])
def test_a_stopped_rank_is_named_stopped_wherever_its_progress_says_it_is(where, stopped_pid) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monitor = CollectiveMonitor(store, rank=0, world_size=2, timeout=30.0, interval=60.0)
    try:
        monitor.waiting(21, "all-gather of unit <root>")
        number, waiting = {"behind": (20, False), "waiting in it": (21, True), "ahead": (22, True)}[where]
        entry = {"number": number, "description": "all-gather of unit <root>", "waiting": waiting,
                 "since": time.time() - 5, "host": socket.gethostname(), "pid": stopped_pid, "beat": 3}
        store.set("xshard/progress/1", json.dumps(entry))
        dead, message = monitor.explain(21)
    finally:
        monitor.stop()
    assert not dead, message
    assert (f"These ranks are stopped, and the collective cannot complete until they go on: rank 1 (its process "
            f"{stopped_pid} is stopped (SIGSTOP, or a debugger holds it); its last collective is #{number}, "
            "all-gather of unit <root>, ") in message, message
    assert "never arrived" not in message and "Waiting in it as well" not in message and "ahead" not in message
