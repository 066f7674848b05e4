"""Run a command the way a user runs it, and report a hang with every process's Python stacks.

``run_job(cmd, timeout=..., env=..., cwd=...)`` is ``subprocess.run(cmd, capture_output=True, text=True,
timeout=...)`` for a command that starts processes of its own (``xshard launch``, torchrun, a Trainer
script): when ``timeout`` passes, each process of the job, the ranks first and the launcher last, gets
SIGABRT, on which Python's faulthandler (``PYTHONFAULTHANDLER=1`` in the job's environment) writes its
threads' stacks to its stderr; the test then fails with the command, the output so far and those stacks,
where a bare ``TimeoutExpired`` would name the command only. ``timeout`` is also shortened to end before
the test's pytest-timeout (``support.deadline.fit``), which would otherwise kill the test first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from support.deadline import fit

#: seconds the aborted processes get to write their stacks and the launcher to pass them on
_DUMP_S = 10


def _children() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, read from /proc (Linux)."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (name) state ppid ...": the name may hold spaces, so split after its closing parenthesis
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(stat.parent.name))
    return tree


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, deepest first."""
    tree, out = _children(), []

    def walk(p: int) -> None:
        for child in tree.get(p, []):
            walk(child)
            out.append(child)

    walk(pid)
    return out


def _abort(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            continue
        time.sleep(0.3)  # one process's stacks at a time: they share the job's stderr


def run_job(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            ) -> subprocess.CompletedProcess:
    """``cmd``'s exit code and output; a hang fails with each of its processes' Python stacks."""
    timeout = fit(timeout)
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        out, err = _stacks_of(proc)
    finally:  # done, hung, or the test ended (pytest-timeout, ^C): nothing of the job outlives it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise AssertionError(f"{' '.join(map(str, cmd))} did not finish in {timeout:.0f}s; its output so far and the "
                         f"Python stacks of each of its processes (SIGABRT, faulthandler):\n{out[-3000:]}\n"
                         f"{err[-12000:]}")


def _stacks_of(proc: subprocess.Popen) -> tuple[str, str]:
    """Abort every process of a hung job, the deepest first, and read what they wrote."""
    _abort(_descendants(proc.pid))  # the ranks (and what they started) write their stacks
    time.sleep(2)  # a launcher that sees its ranks fail says so and ends; one still there is aborted too
    _abort([proc.pid])
    try:
        return proc.communicate(timeout=_DUMP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()
