"""Run a command the way a user runs it, and report a hang with every process's Python stacks.

``run_job(cmd, timeout=..., env=..., cwd=...)`` is ``subprocess.run(cmd, capture_output=True, text=True,
timeout=...)`` for a command that starts processes of its own (``xshard launch``, torchrun, a Trainer
script): when ``timeout`` passes, each process of the job, the ranks first and the launcher last, gets
SIGABRT, on which Python's faulthandler (``PYTHONFAULTHANDLER=1`` in the job's environment) writes its
threads' stacks to its stderr; the test then fails with the command, the output so far and those stacks,
where a bare ``TimeoutExpired`` would name the command only. ``timeout`` is also shortened to end before
the test's pytest-timeout (``support.deadline.fit``), which would otherwise kill the test first.

``run_anchor(cmd, written=..., ...)`` runs a third-party anchor (a stock Trainer on Accelerate's DDP): its exit
cannot fail the test. Once ``written()`` says the files the test reads are complete, the job gets
``EXIT_GRACE_S`` seconds to end; one still there is ended (its stacks written first, as for a hang) and the test
reads its files, with a warning naming the leftover. The stock gloo teardown can hang a rank at exit: the DDP
Reducer drops the last reference to ``ProcessGroupGloo`` after ``destroy_process_group()`` (TRL's ``sft.py``
calls ``trainer.end()``), and the group's destructor joins its worker thread while holding the GIL, which that
thread needs to free the last collective's tensors (pytorch/pytorch#56297; seen in 1 of 6 runs of ``sft.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from support.deadline import fit

#: seconds the aborted processes get to write their stacks and the launcher to pass them on
_DUMP_S = 10
#: seconds an anchor job gets to end once its files are written (it ends in 1-3 s when its teardown does not hang)
EXIT_GRACE_S = 20.0


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


@dataclass
class AnchorRun:
    """An anchor job's result: its exit code (-9 where the test ended it) and whether it had written the files
    the test reads before it ended."""

    args: list[str]
    returncode: int
    written: bool
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """It exited 0, or it wrote everything the test reads (its exit is not under test)."""
        return self.returncode == 0 or self.written


def run_anchor(cmd: list[str], *, written: Callable[[], bool], timeout: float, env: dict[str, str] | None = None,
               cwd: str | Path | None = None, exit_grace: float = EXIT_GRACE_S) -> AnchorRun:
    """Run a third-party anchor job until it exits, or until ``exit_grace`` seconds after ``written()`` is true
    (the files the test reads are complete); a job that does neither within ``timeout`` fails as ``run_job``'s."""
    timeout = fit(timeout)
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    streams: dict[str, str] = {}
    readers = [threading.Thread(target=lambda name=name, f=f: streams.__setitem__(name, f.read()), daemon=True)
               for name, f in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    start, written_at, ended_by_test = time.monotonic(), None, False
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if written_at is None and written():
                written_at = now
            if (written_at is not None and now - written_at > exit_grace) or now - start > timeout:
                ended_by_test = True
                _abort(_descendants(proc.pid))  # each process writes its stacks (faulthandler)
                time.sleep(2)
                _abort([proc.pid])
                break
            time.sleep(0.5)
    finally:  # done, hung, or the test ended: nothing of the job outlives it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        for reader in readers:
            reader.join(_DUMP_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    out, err = streams.get("out", ""), streams.get("err", "")
    complete = written_at is not None or written()
    if ended_by_test and not complete:
        raise AssertionError(f"{' '.join(map(str, cmd))} did not finish in {timeout:.0f}s; its output so far and "
                             f"the Python stacks of each of its processes (SIGABRT, faulthandler):\n{out[-3000:]}\n"
                             f"{err[-12000:]}")
    if complete and (ended_by_test or proc.returncode != 0):
        how = f"had not ended {exit_grace:.0f}s later (ended by the test)" if ended_by_test \
            else f"then exited {proc.returncode}"
        warnings.warn(f"{' '.join(map(str, cmd[-3:]))}: an anchor wrote its output but {how}; the test reads its "
                      f"files. Its stderr's end:\n{err[-4000:]}", stacklevel=2)
    return AnchorRun(list(map(str, cmd)), proc.returncode, complete, out, err)


def json_written(*paths: Path) -> Callable[[], bool]:
    """A ``written`` check for ``run_anchor``: every one of ``paths`` holds a whole JSON document (a file the job
    writes in place may be read half written)."""

    def check() -> bool:
        for path in paths:
            try:
                json.loads(path.read_text())
            except (OSError, ValueError):
                return False
        return True

    return check


def run_writing(cmd: list[str], files: list[Path], *, anchor: bool, timeout: float,
                env: dict[str, str] | None = None, cwd: str | Path | None = None) -> tuple[str, str]:
    """Run a job whose results are the JSON ``files`` it writes; its stdout and stderr. xshard's job must exit 0
    (``run_job``); an anchor's is held to its files only (``run_anchor``: its exit is not under test)."""
    if anchor:
        done = run_anchor(cmd, written=json_written(*files), timeout=timeout, env=env, cwd=cwd)
        assert done.ok, done.stdout[-3000:] + done.stderr[-5000:]
        return done.stdout, done.stderr
    proc = run_job(cmd, timeout=timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout, proc.stderr
