"""Tie a process to the launcher that started it: when the launcher dies, however it dies, so does the process.

A launcher killed with SIGKILL (the OOM killer, a scheduler's hard kill) runs no code, so it cannot
stop its children; without help they keep running as orphans, holding devices, memory and ports.
On Linux each child asks the kernel for a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``)
before it runs anything else; the setting survives ``exec``, so the training script is then
started exactly as it would be without the guard. Elsewhere (macOS) the guard stays as the
script's parent and polls whether the launcher is still its own parent.

This file uses the standard library only and runs by path, before any package import:

    python parent_death.py COMMAND...      # with XSHARD_LAUNCHER_PID=<pid of the launcher>
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

#: the environment variable naming the launcher's pid (taken out before the command runs)
PARENT_ENV = "XSHARD_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux); False elsewhere.

    The kernel sends it when the thread that started this process ends: launchers start their
    children from their main thread, which lives as long as the launcher.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def tie_to_parent(parent_pid: int) -> bool:
    """Die with ``parent_pid`` (this process's parent). Exits at once if that parent is already gone
    (it may die between starting this process and the signal being set). False where the platform
    has no parent-death signal: use ``supervise`` then."""
    if not set_parent_death_signal():
        return False
    if os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)
    return True


def supervise(parent_pid: int, command: Sequence[str], poll_seconds: float = 0.5) -> int:
    """Run ``command`` as a child, forward SIGINT/SIGTERM to it, and kill it as soon as ``parent_pid``
    is no longer this process's parent. Returns the child's exit code as a shell reports it."""
    child = subprocess.Popen(list(command))

    def forward(signum: int, frame: object) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    while True:
        try:
            code = child.wait(timeout=poll_seconds)
            return 128 - code if code < 0 else code
        except subprocess.TimeoutExpired:
            if os.getppid() != parent_pid:
                child.kill()
                child.wait()
                return 128 + signal.SIGKILL


def run_tied(parent_pid: int, command: Sequence[str]) -> int:
    """Become ``command`` with a parent-death signal (Linux), or supervise it (elsewhere)."""
    if tie_to_parent(parent_pid):
        os.execvp(command[0], list(command))
    return supervise(parent_pid, command)


def main(argv: Sequence[str]) -> int:
    """``python parent_death.py COMMAND...``: run COMMAND tied to the process in $XSHARD_LAUNCHER_PID."""
    if not argv:
        print("usage: parent_death.py COMMAND... (with XSHARD_LAUNCHER_PID set)", file=sys.stderr)
        return 2
    raw = os.environ.pop(PARENT_ENV, "")
    parent_pid = int(raw) if raw.isdigit() else os.getppid()
    return run_tied(parent_pid, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
