"""Hang diagnosis: when a collective waits too long, say which ranks never arrived and where they are.

Without it, a rank that stops before a collective (a deadlock in user code, a stuck data loader, a
branch only some ranks take) leaves the others blocked until the process-group timeout, and the error
then names the rank that was *waiting*. Here every rank publishes, through the job's key-value store,
its latest collective (number, what it moves, whether it is waiting in it, since when). When a wait
on this rank lasts longer than the deadline (just under the process-group timeout, so the message
comes before NCCL's watchdog tears the process down), the monitor reads every rank's entry and logs
one message naming the ranks that never arrived, what they did last and what the others wait in;
the error the wait then raises carries the same message (``CollectiveTimeoutError``).

A rank that died (killed, crashed, its node lost) is named as dead, never as late: every entry
carries the rank's host and process id and a heartbeat. When a wait fails before the deadline (the
process group saw a peer's connection close) or the deadline passes, a rank on this host whose
process is gone (or a zombie) is dead at once; one elsewhere is dead when its heartbeat stops
advancing for a few beats. The error is then ``RankDiedError`` naming it. A rank never lists itself.

Cost: the main thread only stores a small tuple when a wait starts and ends; a daemon thread
publishes it about once a second when it changed (and a heartbeat every few seconds) and checks the
deadline. No store traffic happens on the training path.

Lifetime: a process may hold several monitors (a Trainer script's arguments and its Accelerator each
have a backend, and the one that did not form the group runs the collectives). Leaving the group stops
all of them (``stop_all``), and so does the interpreter's exit, each waiting for its thread: a daemon
thread still inside a store call when the interpreter finalizes cannot take the GIL back, and the
process aborts ("terminate called without an active exception") after the script did all its work.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

log = logging.getLogger("xshard.backends")

_KEY = "xshard/progress/{rank}"
#: seconds between heartbeats when nothing else changed (a dead rank's stops advancing)
HEARTBEAT = 2.0
#: how long stopping a monitor waits for its thread's store call to return
STOP_WAIT_S = 2.0

#: every monitor of this process whose thread runs (each thread holds its monitor while it runs)
_running: weakref.WeakSet[CollectiveMonitor] = weakref.WeakSet()


def stop_all() -> None:
    """Stop every monitor of this process and wait for its thread (see the module docstring)."""
    for monitor in list(_running):
        monitor.stop()


atexit.register(stop_all)


class CollectiveMonitor:
    """Publishes this rank's collective progress and diagnoses waits that outlast ``deadline`` seconds."""

    def __init__(self, store: Any, rank: int, world_size: int, deadline: float, interval: float = 1.0) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.deadline = float(deadline)
        self.interval = interval
        #: (number, description, waiting, wall-clock time of the last change), set by the main thread
        self.state: tuple[int, str, bool, float] = (0, "nothing yet", False, time.time())
        self.diagnosis: str | None = None
        self._published: tuple[int, str, bool, float] | None = None
        self._published_at = 0.0
        self._beat = 0
        self._host = socket.gethostname()
        self._diagnosed_for: int | None = None
        self._diagnosed_dead = False
        self._stop = threading.Event()
        self._publish()  # at once: a rank that dies before the thread's first beat is still known by its pid
        self._thread = threading.Thread(target=self._run, name="xshard-collective-monitor", daemon=True)
        self._thread.start()
        _running.add(self)

    # ------------------------------------------------------------------ main thread
    def waiting(self, number: int, description: str) -> None:
        """The main thread starts waiting for collective ``number``."""
        self.state = (number, description, True, time.time())

    def done(self, number: int, description: str) -> None:
        """The wait for collective ``number`` ended."""
        self.state = (number, description, False, time.time())

    def stop(self) -> None:
        """End the monitor thread, waiting up to ``STOP_WAIT_S`` for a store call it is in."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)
        _running.discard(self)

    # ------------------------------------------------------------------ monitor thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                number, _, waiting, since = self.state
                if waiting and time.time() - since >= self.deadline and self._diagnosed_for != number:
                    self._diagnosed_for = number
                    self.diagnosis = self.diagnose()
                    log.error("%s", self.diagnosis)
            except Exception as exc:  # the store went away (job ending): stop quietly
                log.debug("collective monitor stops: %s", exc)
                return

    def _publish(self) -> None:
        state = self.state
        if state != self._published or time.monotonic() - self._published_at >= HEARTBEAT:
            number, description, waiting, since = state
            self._beat += 1
            self.store.set(_KEY.format(rank=self.rank), json.dumps(
                {"number": number, "description": description, "waiting": waiting, "since": since,
                 "host": self._host, "pid": os.getpid(), "beat": self._beat}))
            self._published, self._published_at = state, time.monotonic()

    def _entries(self) -> dict[int, dict[str, Any] | None]:
        """Every other rank's published entry (None: nothing published, or the store cannot say)."""
        entries: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                entries[r] = json.loads(self.store.get(_KEY.format(rank=r)))
            except Exception:
                entries[r] = None
        return entries

    def _store_answers(self) -> bool:
        try:
            self.store.get(_KEY.format(rank=self.rank))
            return True
        except Exception:
            return False

    def dead_ranks(self, entries: dict[int, dict[str, Any] | None], patience: float = 0.0) -> dict[int, str]:
        """Ranks among ``entries`` that died, each with how it is known. On this host: the process is gone
        or a zombie. Elsewhere (only when ``patience`` > 0): its heartbeat did not advance for that many
        seconds (this call waits that long)."""
        dead: dict[int, str] = {}
        remote: dict[int, Any] = {}
        for r, e in entries.items():
            if e is None or "pid" not in e:
                continue
            if e.get("host") == self._host:
                how = _process_gone(int(e["pid"]))
                if how:
                    dead[r] = f"process {e['pid']} on this host {how}"
            else:
                remote[r] = e.get("beat")
        if remote and patience > 0:
            time.sleep(patience)
            for r, e in self._entries().items():
                if r in remote and e is not None and e.get("beat") == remote[r]:
                    dead[r] = f"no heartbeat from process {e['pid']} on {e.get('host')} for {patience:.0f} s"
        return dead

    def explain_failure(self, reported: str) -> tuple[bool, str]:
        """Why the wait this rank is in failed (``reported``: the process group's words): (whether a rank
        died, the message). Called by the waiting thread as the wait fails."""
        number, description, _, since = self.state
        if self.diagnosis is not None and self._diagnosed_for == number:
            return self._diagnosed_dead, self.diagnosis
        entries = self._entries()
        if entries and all(e is None for e in entries.values()) and not self._store_answers():
            return True, (f"the process that holds the job's key-value store (the launcher, or rank 0 when the job "
                          f"was started without one) died while rank {self.rank} waited in collective #{number} "
                          f"({description}); look at its output for why it ended, then resume from the last "
                          "checkpoint.")
        dead = self.dead_ranks(entries) or self.dead_ranks(entries, patience=2.5 * HEARTBEAT)
        if dead:
            return True, (f"{_died(dead)} while rank {self.rank} waited in collective #{number} ({description}) "
                          f"for {time.time() - since:.0f} s; the job cannot go on without it: look at that rank's "
                          "output (or the launcher's line) for why it ended, then resume from the last checkpoint.")
        return False, self.diagnose(entries)

    def diagnose(self, entries: dict[int, dict[str, Any] | None] | None = None) -> str:
        """Who never arrived at the collective this rank waits in (or died), and where every rank is."""
        number, description, _, since = self.state
        now = time.time()
        if entries is None:
            entries = self._entries()
        dead = self.dead_ranks(entries)
        self._diagnosed_dead = bool(dead)
        behind = {r: e for r, e in entries.items() if r not in dead and (e is None or e["number"] < number)}
        waiting_too = sorted(r for r, e in entries.items()
                             if r not in dead and e is not None and e["number"] == number and e["waiting"])
        elsewhere = {r: e for r, e in entries.items() if r not in dead and e is not None and e["number"] > number}
        lines = [f"collective #{number} ({description}) has waited {now - since:.0f} s on rank {self.rank}."]
        if dead:
            lines.append(f"{_died(dead)}: the job cannot go on without it; look at its output (or the "
                         "launcher's line) for why it ended, then resume from the last checkpoint.")
        if behind:
            parts = []
            for r, e in sorted(behind.items()):
                if e is None:
                    parts.append(f"rank {r} (no progress published: it may have died or never started)")
                    continue
                state = "waiting in it" if e["waiting"] else f"finished {now - e['since']:.0f} s ago"
                parts.append(f"rank {r} (its last collective is #{e['number']}, {e['description']}, {state})")
            lines.append("These ranks never arrived: " + "; ".join(parts) + ". Look at what they do after that "
                         "collective: a deadlock, a stuck data loader, or a branch only some ranks take "
                         "(e.g. code under `if accelerator.is_main_process:` that runs the model: use "
                         "model.summon_full_params() on every rank).")
        if elsewhere:
            lines.append("Ranks ahead of this one (a different collective sequence): " + "; ".join(
                f"rank {r} at #{e['number']} ({e['description']})" for r, e in sorted(elsewhere.items())) + ".")
        if waiting_too:
            lines.append(f"Waiting in it as well: ranks {', '.join(map(str, waiting_too))}.")
        return " ".join(lines)


def _died(dead: dict[int, str]) -> str:
    return "; ".join(f"rank {r} died ({how})" for r, how in sorted(dead.items()))


def _process_gone(pid: int) -> str:
    """"has exited" / "was killed and not yet reaped" for a dead process of this host, "" for a live one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return "is a zombie (it exited or was killed)" if state in ("Z", "X") else ""
    except FileNotFoundError:
        return "has exited"
    except (OSError, IndexError):  # no /proc (macOS): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "has exited"
        except OSError:
            return ""
        return ""
