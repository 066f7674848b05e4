"""Helpers for tests that kill a launcher: the rank processes it started, found by the pid files they write."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

#: a rank that writes its pid to ``<folder>/pid<RANK>`` (atomically), then waits to be stopped
SLEEPER = r'''
import os, sys, time
path = os.path.join(sys.argv[1], "pid" + os.environ.get("RANK", "0"))
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(300)
'''


def wait_for_pids(folder: Path, count: int, launcher: subprocess.Popen, timeout: float = 120) -> list[int]:
    """The pids of ``count`` ranks once each has written its file (fails if the launcher ends first)."""
    deadline = time.monotonic() + timeout
    paths = [folder / f"pid{r}" for r in range(count)]
    while not all(p.exists() for p in paths):
        if launcher.poll() is not None:
            raise AssertionError(f"the launcher ended with code {launcher.returncode} before its ranks started")
        if time.monotonic() > deadline:
            raise AssertionError(f"the ranks did not start within {timeout}s")
        time.sleep(0.2)
    return [int(p.read_text()) for p in paths]


def alive(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that are still running (zombies count as gone)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            running.append(pid)
    return running


def gone_within(pids: list[int], seconds: float) -> bool:
    """Whether every process in ``pids`` has ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pids)


def kill_all(pids: list[int]) -> None:
    """Clean up after a failed test: SIGKILL whatever is left of ``pids``."""
    for pid in alive(list(set(pids))):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
