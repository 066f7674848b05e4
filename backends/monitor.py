"""Hang diagnosis: when a collective waits too long, say which ranks never arrived and where they are.

Without it, a rank that stops before a collective (a deadlock in user code, a stuck data loader, a
branch only some ranks take) leaves the others blocked until the process-group timeout, and the error
then names the rank that was *waiting*. Here every rank publishes, through the job's key-value store,
its latest collective (number, what it moves, whether it is waiting in it, since when). When a wait
on this rank lasts longer than the deadline (just under the process-group timeout, so the message
comes before NCCL's watchdog tears the process down), the monitor reads every rank's entry and logs
one message naming the ranks that never arrived, what they did last and what the others wait in;
the error the wait then raises carries the same message (``CollectiveTimeoutError``).

Cost: the main thread only stores a small tuple when a wait starts and ends; a daemon thread
publishes it about once a second when it changed and checks the deadline. No store traffic happens
on the training path.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

log = logging.getLogger("xshard.backends")

_KEY = "xshard/progress/{rank}"


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
        self._diagnosed_for: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xshard-collective-monitor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main thread
    def waiting(self, number: int, description: str) -> None:
        """The main thread starts waiting for collective ``number``."""
        self.state = (number, description, True, time.time())

    def done(self, number: int, description: str) -> None:
        """The wait for collective ``number`` ended."""
        self.state = (number, description, False, time.time())

    def stop(self) -> None:
        self._stop.set()

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
        if state != self._published:
            number, description, waiting, since = state
            self.store.set(_KEY.format(rank=self.rank), json.dumps(
                {"number": number, "description": description, "waiting": waiting, "since": since}))
            self._published = state

    def diagnose(self) -> str:
        """Who never arrived at the collective this rank waits in, and where every rank is."""
        number, description, _, since = self.state
        now = time.time()
        entries: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world_size):
            try:
                entries[r] = json.loads(self.store.get(_KEY.format(rank=r)))
            except Exception:
                entries[r] = None
        behind = {r: e for r, e in entries.items() if e is None or e["number"] < number}
        waiting_too = sorted(r for r, e in entries.items()
                             if e is not None and e["number"] == number and e["waiting"] and r != self.rank)
        elsewhere = {r: e for r, e in entries.items() if e is not None and e["number"] > number}
        lines = [f"collective #{number} ({description}) has waited {now - since:.0f} s on rank {self.rank}."]
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
