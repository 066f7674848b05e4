"""``CollectiveAgreement``: do the ranks issue the same collectives? Asked off the training path.

Why not on it: the ranks' (count, fingerprint) of a step are host values, but comparing them with an
all-reduce makes the host read a device value (``.tolist()``) at every optimizer step, and on a GPU or
an NPU that read waits until the device has drained its queue: the host can no longer run ahead.

So the check at every optimizer step but the first (``DistCollectives.verify_same_collectives`` keeps
the blocking all-reduce there: the commonest mistake, a branch taken by the rank, is then named before
any update) only hands the step's record to this object, a few hundred nanoseconds on the main thread.
The collective monitor's thread (``backends/diagnostics/monitor.py``) does the rest through the job's key-value
store, at its own pace (about once a second):

- each rank publishes its last ``PUBLISHED_STEPS`` records, (step, count, fingerprint, chain), where
  the chain folds every step's (count, fingerprint) since the first, so two ranks whose chains agree
  at any step agreed at every step before it (steps that went by between two beats are covered too);
- each rank but rank 0 reads rank 0's records and compares the steps it also has: a difference is a
  mismatch. Every rank compares with the same reference, so one store read a rank a beat suffices;
- the first rank that finds one claims the case (``compare_set``: one case a job), every rank answers
  with the entries of its last ``ENTRY_STEPS`` steps (looked for every ``HEARTBEAT``), and the claimant
  writes the message, naming the first collective where the ranks differ (``describe_mismatch``);
- every rank reads it: its main thread raises ``CollectiveMismatchError`` at the next optimizer step,
  and a rank that is waiting in a collective by then (the ranks' collectives differ, so one may never
  complete) has it named by the monitor at once, and raised when that wait fails.

A mismatch is then named within a few seconds of the step where it happened, the updates of those
few steps already applied (the job cannot go on either way). Where the job has no monitor
(``XSHARD_MONITOR=0``), only the first step is checked; ``XSHARD_CHECK_COLLECTIVES=every-step`` checks
every step the blocking way, for debugging (``check_every_step``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from collections import deque
from typing import Any

from ...errors import CollectiveMismatchError
from ..diagnostics.bounded_store import BoundedStore
from ..diagnostics.monitor import HEARTBEAT, CollectiveMonitor
from .trace import _MISMATCH_HINT, describe_mismatch, number

log = logging.getLogger("xshard.backends")

#: the store keys of one agreement (``{n}``: its number in this process, the same on every rank, as SPMD code
#: makes its collectives in the same order: a later Accelerator of the same job never reads an earlier one's
#: records): each rank's latest step records; the one mismatch case, the rank that found it first and the
#: step (set once, by compare_set); each rank's answer to it; its message
RECORDS_KEY = "xshard/collective-agreement/{n}/records/{rank}"
CASE_KEY = "xshard/collective-agreement/{n}/case"
ANSWER_KEY = "xshard/collective-agreement/{n}/answer/{rank}"
MESSAGE_KEY = "xshard/collective-agreement/{n}/message"
#: how many of its latest steps a rank publishes, and keeps the records of
PUBLISHED_STEPS, HISTORY_STEPS = 16, 1024
#: how many collectives' entries (their text) a rank keeps from its latest steps, for the message: the
#: strings the trace made already, held a few seconds longer (a mismatch is named seconds after its step)
ENTRY_BUDGET = 20_000
#: how long the rank that claimed a case waits for every rank's entries before it writes what it has
ANSWER_WAIT_S = 2 * HEARTBEAT + 2.0

#: the values of ``XSHARD_CHECK_COLLECTIVES``
CHECK_SETTINGS = ("auto", "every-step")


def check_every_step() -> bool:
    """``XSHARD_CHECK_COLLECTIVES=every-step``: compare the ranks' collectives with a blocking all-reduce at
    every optimizer step (each then waits for the device); ``auto`` (the default): see the module docstring."""
    value = os.environ.get("XSHARD_CHECK_COLLECTIVES", "auto").strip().lower() or "auto"
    if value not in CHECK_SETTINGS:
        raise ValueError(f"XSHARD_CHECK_COLLECTIVES={value!r} is not one of {CHECK_SETTINGS}: unset it (auto) or "
                         "set every-step to check the ranks' collectives at every step, blocking")
    return value == "every-step"


class CollectiveAgreement:
    """This rank's step records, compared with rank 0's by the monitor's thread (see the module docstring)."""

    #: agreements made by this process so far (numbers their store keys)
    made = 0

    def __init__(self, monitor: CollectiveMonitor, rank: int, world_size: int) -> None:
        CollectiveAgreement.made += 1
        n = CollectiveAgreement.made
        self._records_key, self._case_key = RECORDS_KEY.replace("{n}", str(n)), CASE_KEY.format(n=n)
        self._answer_key, self._message_key = ANSWER_KEY.replace("{n}", str(n)), MESSAGE_KEY.format(n=n)
        self.rank, self.world_size = rank, world_size
        self._store: BoundedStore = monitor.store
        self._monitor = monitor
        self._lock = threading.Lock()
        #: step -> (count, fingerprint, chain), the latest HISTORY_STEPS of them
        self._records: dict[int, tuple[int, int, int]] = {}
        self._steps: deque[int] = deque()
        #: step -> (count, the kept entries), of the latest steps within ENTRY_BUDGET entries in all
        self._entries: dict[int, tuple[int, deque[str]]] = {}
        self._entries_held = 0
        self._chain = 0
        self._latest = 0
        self._published = 0
        self._compared = 0
        self._case: dict[str, Any] | None = None
        self._case_looked_at = 0.0
        self._answers: dict[int, dict[str, Any]] = {}
        self._case_since = 0.0
        self._message_written = False
        #: the message, once the ranks' collectives were found to differ (raised by the main thread)
        self.mismatch: str | None = None
        monitor.beat_work.append(self.beat)

    # ------------------------------------------------------------------ main thread
    def close_step(self, step: int, count: int, fingerprint: int, entries: deque[str]) -> None:
        """Record what this rank issued in optimizer step ``step`` (no store call, no device read)."""
        self._chain = zlib.crc32(f"{count}:{fingerprint}".encode(), self._chain)
        with self._lock:
            self._records[step] = (count, fingerprint, self._chain)
            self._steps.append(step)
            if len(self._steps) > HISTORY_STEPS:
                del self._records[self._steps.popleft()]
            self._entries[step] = (count, entries)
            self._entries_held += len(entries)
            while self._entries_held > ENTRY_BUDGET and len(self._entries) > 1:
                self._entries_held -= len(self._entries.pop(next(iter(self._entries)))[1])
            self._latest = step

    def raise_if_mismatched(self) -> None:
        """Raise ``CollectiveMismatchError`` where the monitor's thread found the ranks' collectives differ."""
        if self.mismatch is not None:
            raise CollectiveMismatchError(self.mismatch)

    # ------------------------------------------------------------------ the monitor's thread
    def beat(self) -> None:
        """One beat of the monitor's thread: publish, compare with rank 0, follow a case. Store calls only."""
        if self.mismatch is not None or self._latest == 0:
            return  # found; or no step recorded (a second backend of the process that runs no collective)
        latest = self._latest
        if latest != self._published:
            text = json.dumps(self._latest_records(PUBLISHED_STEPS))
            self._store.run(lambda store: store.set(self._records_key.format(rank=self.rank), text))
            self._published = latest
        if self.rank != 0 and latest != self._compared and self._case is None:
            self._compare_with_rank0()
            self._compared = latest
        self._follow_case()

    def _get(self, key: str) -> bytes | None:
        """The store's value of ``key``, or None where it has none yet (``get`` would wait for it)."""
        value: bytes | None = self._store.run(lambda store: store.get(key) if store.check([key]) else None)
        return value

    def _latest_records(self, n: int) -> list[list[int]]:
        with self._lock:
            return [[s, *self._records[s]] for s in list(self._steps)[-n:]]

    def _compare_with_rank0(self) -> None:
        text = self._get(self._records_key.format(rank=0))
        if text is None:
            return
        with self._lock:
            mine = dict(self._records)
        differing = [step for step, _count, _fingerprint, chain in json.loads(text)
                     if step in mine and mine[step][2] != chain]
        if differing:
            claim = json.dumps({"rank": self.rank, "step": min(differing)})
            self._store.run(lambda store: store.compare_set(self._case_key, "", claim))
            self._case_looked_at = 0.0  # read the case at once

    def _follow_case(self) -> None:
        """Answer a case with this rank's entries; write its message where this rank claimed it; read it."""
        if self._case is None:
            if time.monotonic() - self._case_looked_at < HEARTBEAT:
                return  # looked for at the heartbeat's pace
            self._case_looked_at = time.monotonic()
            text = self._get(self._case_key)
            if text is None:
                return
            self._case, self._case_since = json.loads(text), time.monotonic()
            answer = json.dumps(self._answer())
            self._store.run(lambda store: store.set(self._answer_key.format(rank=self.rank), answer))
        if self._case["rank"] == self.rank:
            self._gather_answers()
        message = self._get(self._message_key)
        if message is not None:
            self.mismatch = message.decode()
            self._monitor.report_mismatch(self.mismatch)

    def _answer(self) -> dict[str, Any]:
        """This rank's records (step, count, fingerprint) and the entries it still keeps, by step."""
        with self._lock:
            return {"records": [[s, *self._records[s][:2]] for s in self._steps],
                    "entries": {str(s): number(count, entries) for s, (count, entries) in self._entries.items()}}

    def _gather_answers(self) -> None:
        """Read the ranks' answers (a few each beat, never waiting); once all are in, or ``ANSWER_WAIT_S`` passed,
        write the message."""
        if self._message_written:
            return
        for r in range(self.world_size):
            text = self._get(self._answer_key.format(rank=r)) if r not in self._answers else None
            if text is not None:
                self._answers[r] = json.loads(text)
        if len(self._answers) < self.world_size and time.monotonic() - self._case_since < ANSWER_WAIT_S:
            return
        message = describe_case(self._answers, self.world_size, self._case["step"] if self._case else 0)
        self._store.run(lambda store: store.set(self._message_key, message))
        self._message_written = True


def describe_case(answers: dict[int, dict[str, Any]], world_size: int, found_at: int) -> str:
    """The mismatch message from the ranks' answers: the first step where their (count, fingerprint) differ, and
    in it the first collective where their entries differ (where every rank still keeps that step's entries)."""
    records = {r: {s: (count, fingerprint) for s, count, fingerprint in a["records"]} for r, a in answers.items()}
    steps = sorted({s for mine in records.values() for s in mine})
    first = next((s for s in steps if len({mine[s] for mine in records.values() if s in mine}) > 1), None)
    if first is None:
        text = (f"ranks issued different collectives at or before optimizer step {found_at} (the step is older than "
                f"the {HISTORY_STEPS} each rank keeps the record of).")
    elif all(str(first) in a["entries"] for a in answers.values()):
        text = describe_mismatch({r: {"count": records[r][first][0], "entries": a["entries"][str(first)]}
                                  for r, a in answers.items()})
    else:
        counts = ", ".join(f"rank {r}: {mine[first][0]}" for r, mine in sorted(records.items()) if first in mine)
        text = (f"ranks issued different collectives (counts {counts}); which collectives is no longer known (each "
                f"rank keeps the last {ENTRY_BUDGET} collectives' names).")
    missing = sorted(set(range(world_size)) - set(answers))
    unheard = f" (ranks {', '.join(map(str, missing))} did not answer)" if missing else ""
    return f"optimizer step {first if first is not None else found_at}: {text}{unheard} {_MISMATCH_HINT}"
