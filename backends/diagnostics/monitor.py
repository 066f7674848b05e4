"""Hang diagnosis: when a collective waits too long, say which ranks never arrived and where they are.

Without it, a rank that stops before a collective (a deadlock in user code, a stuck data loader, a
branch only some ranks take) leaves the others blocked until the process-group timeout, and the error
then names the rank that was *waiting*. Here every rank publishes, through the job's key-value store,
its latest collective (number, what it moves, whether it is waiting in it, since when). When a wait
on this rank lasts longer than the deadline (90% of the process-group timeout, so the message
comes before NCCL's watchdog tears the process down), the monitor reads every rank's entry and logs
one message naming the ranks that never arrived, what they did last and what the others wait in;
the error the wait then raises carries the same message (``CollectiveTimeoutError``).

A rank that is lost is named for what happened to it, never as late: every entry carries the rank's
host, process id and a heartbeat. A rank whose script ended with an exception publishes it first
(``crashed``: its peers quote it). On this host, a rank whose process is gone (or a zombie) is dead;
when the process group saw a connection close, the live ones are watched for ``PATIENCE`` seconds (a
killed process closes its sockets a moment before it is a zombie). Elsewhere, a rank whose heartbeat
stopped for ``PATIENCE`` seconds is dead when a connection closed (a process that ends closes its
sockets) and unreachable when none did (its node is down or cut off). The error is then
``RankDiedError``. "Never arrived" is said only of live ranks; a process on this host that a signal or a
debugger stopped is named stopped, wherever its entry says it is. A rank never lists itself.

The diagnosis never waits on the store it diagnoses: a store cut off from this host answers nothing,
ever (``backends/diagnostics/bounded_store.py``), so each store call gives up after a bound (a fifth of the timeout,
2 to 10 s), and a store that gave no answer is named unreachable, with the ranks of the other nodes
(their hosts were read at the start).

Ranks that issued different collectives are named here too: a wait that lasts ``EARLY_LOOK_S`` reads the
reference peer's entry (rank 0's; rank 1's for rank 0), and a peer at the same collective number with another
description cannot complete this one: the mismatch is logged at once (``report_mismatch``), not at the
deadline, with where every rank is (each one's entry read then: its collective, whether it waits in it, and
the line of the user's code it waits from), and the wait, when it fails, raises ``CollectiveMismatchError``.
The collectives agreement check (``collectives/agreement.py``) runs its store calls on this thread too
(``beat_work``).

Where a rank waits from (``where``: "train.py:42 in main") is the innermost frame of the waiting thread that is
not xshard's, torch's, the standard library's or an installed package's (the first that is not xshard's or
torch's where every frame is one of those). The monitor's thread reads it (``sys._current_frames``) when it
publishes a wait, while the waiting thread is blocked in it, so the training path only records which thread
waits; a wait that ended meanwhile is published without it.

Cost: the main thread only stores a small tuple (and its thread's id) when a wait starts and ends; a daemon thread
publishes it about once a second when it changed (and a heartbeat every few seconds) and checks the
deadline; a second one makes the store calls. No store traffic happens on the training path, and no
thread starts or ends while the job trains (a fork then could hang: ``backends/diagnostics/bounded_store.py``).

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
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ...errors import leave_for_the_launcher
from .bounded_store import BoundedStore, StoreFailed, StoreUnreachable
from .flight_recorder import FlightRecorder

log = logging.getLogger("xshard.backends")

_KEY = "xshard/progress/{rank}"
#: a rank that failed asks every rank for its flight records here (``write_flight``); each counts its answer
_FLIGHT_KEY = "xshard/flight/request"
_FLIGHT_ANSWERS = "xshard/flight/answers"
#: seconds between heartbeats when nothing else changed (a dead rank's stops advancing)
HEARTBEAT = 2.0
#: how long a rank that asks for every rank's flight records waits for their answers (they look every HEARTBEAT)
FLIGHT_ANSWER_WAIT_S = HEARTBEAT + 1.5
#: how long stopping a monitor waits for its thread's store call to return
STOP_WAIT_S = 2.0
#: seconds a peer elsewhere may go without a heartbeat before it counts as lost
PATIENCE = 2.5 * HEARTBEAT
#: the largest job whose ranks learn every peer's host at the start, and how many beats they try
LEARN_UP_TO, LEARN_TRIES = 64, 30

#: how long the main thread waits in a collective before the monitor asks whether a peer issued another one there
EARLY_LOOK_S = 3.0
#: how many of its latest collectives a waiting rank publishes with its wait (``_differ``)
RECENT = 16
#: what to do about ranks that issue different collectives
MISMATCH_HINT = (
    "Every rank must issue the same collectives in the same order. Look for: a collective of the script's own "
    "issued on some ranks only (e.g. accelerator.gather, reduce or wait_for_everyone under `if "
    "accelerator.is_main_process:`: call it on every rank, and use its result on one); a model whose units run "
    "in a different order on different ranks, or one unit called a different number of times (a branch may "
    "skip a unit on some ranks, not reorder or repeat one: make the order the same on every rank, or make the "
    "modules that differ part of one unit, e.g. their parent with transformer_layer_cls_to_wrap); a different "
    "model on each rank (build and prepare the same one everywhere). To run the model on one rank alone (e.g. "
    "generate() on rank 0), enter model.summon_full_params() on every rank first.")

#: every monitor of this process whose thread runs (each thread holds its monitor while it runs)
_running: weakref.WeakSet[CollectiveMonitor] = weakref.WeakSet()


def stop_all() -> None:
    """Stop every monitor of this process and wait for its thread (see the module docstring)."""
    for monitor in list(_running):
        monitor.stop()


atexit.register(stop_all)


class CollectiveMonitor:
    """Publishes this rank's collective progress and diagnoses waits that outlast 90% of ``timeout`` seconds
    (the process group's timeout, which the backend holds)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float, interval: float = 1.0,
                 flight: FlightRecorder | None = None) -> None:
        #: the job's flight recorder (``flight_recorder.py``), written when the job fails
        self.flight = flight
        self._flight_answered = False
        self._flight_logged = False
        self._flight_checked_at = 0.0
        self._flight_asked = False
        self.timeout = float(timeout)
        self.deadline = 0.9 * self.timeout
        self.store = BoundedStore(store, bound=store_bound(self.timeout))
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        #: (number, description, waiting, wall-clock time of the last change), set by the main thread
        self.state: tuple[int, str, bool, float] = (0, "nothing yet", False, time.time())
        #: the id of the thread that waits (``state``'s wait), set by that thread with it
        self._waiter: int | None = None
        #: where the user's code waits in ``state``'s wait ("train.py:42 in main"), as read for that state object
        self._where: tuple[tuple[int, str, bool, float] | None, str | None] = (None, None)
        self.diagnosis: str | None = None
        self._published: tuple[tuple[int, str, bool, float], str | None] | None = None
        self._published_at = 0.0
        self._beat = 0
        self._host = socket.gethostname()
        self._diagnosed_for: int | None = None
        self._compared_waits_at = 0.0
        self._diagnosed_dead = False
        #: the peers' entries as last read (their hosts and pids, learnt at the start: a lost store still has names)
        self._known: dict[int, dict[str, Any]] = {}
        self._learn_tries = 0
        #: (collective number, monotonic time, the peers' beats) read ``PATIENCE`` before the deadline
        self._snapshot: tuple[int, float, dict[int, Any]] | None = None
        self.crashed: str | None = None
        #: work the monitor's thread does at every beat, after publishing (the collectives agreement check:
        #: ``collectives/agreement.py``); each may make store calls
        self.beat_work: list[Callable[[], None]] = []
        #: the ranks' collectives differ (the agreement check's message): a wait that fails says so
        self.mismatch: str | None = None
        self._stop = threading.Event()
        try:
            self._publish()  # at once: a rank that dies before the thread's first beat is still known by its pid
        except StoreUnreachable:
            pass
        self._thread = threading.Thread(target=self._run, name="xshard-collective-monitor", daemon=True)
        self._thread.start()
        _running.add(self)
        _report_crashes()

    # ------------------------------------------------------------------ main thread
    def waiting(self, number: int, description: str) -> None:
        """The main thread starts waiting for collective ``number``."""
        self._waiter = threading.get_ident()
        self.state = (number, description, True, time.time())

    def done(self, number: int, description: str) -> None:
        """The wait for collective ``number`` ended."""
        self.state = (number, description, False, time.time())

    def stop(self) -> None:
        """End the monitor thread, waiting up to ``STOP_WAIT_S`` for a store call it is in."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)
        # a call to a store that answers ends soon; one that does not, never (its thread is left in it)
        self.store.close(0.0 if self.store.silent_for else STOP_WAIT_S)
        _running.discard(self)

    def report_mismatch(self, message: str) -> None:
        """The ranks' collectives differ (``message``, found by the monitor's thread): log it once, and where
        the main thread waits in a collective (one that may never complete, the ranks' sequences differing),
        say so: the wait, when it fails, raises the mismatch."""
        if self.mismatch is not None:
            return
        self.mismatch = message
        number, description, waiting, since = self.state
        if waiting:
            log.error("rank %d waits in collective #%d (%s) since %.0f s, and the ranks' collectives differ: %s",
                      self.rank, number, description, time.time() - since, message)
            self.write_flight(f"the ranks' collectives differ: {message}")
        else:
            log.error("rank %d: %s", self.rank, message)

    def _compare_waits(self, number: int, description: str) -> None:
        """This rank waits in collective ``number``: if the reference peer (rank 0; rank 1 for rank 0) issued a
        different collective under that number, neither can complete: name it now, not at the deadline, with
        where every rank is (every entry read once, then). One store read every ``HEARTBEAT`` of a wait that
        lasts ``EARLY_LOOK_S`` or more."""
        peer = 1 if self.rank == 0 else 0
        key = _KEY.format(rank=peer)
        text = self.store.run(lambda store: store.get(key) if store.check([key]) else None)
        entry = json.loads(text) if text is not None else None
        differ = self._differ(number, description, entry) if entry is not None else None
        if differ is None:
            return
        at, mine, theirs = differ
        try:
            entries = self._read_entries()
        except (StoreUnreachable, StoreFailed):  # the pair is known: name it with what was read
            entries = {peer: entry}
        message = (f"ranks issued different collectives: at collective #{at} of the job, rank {self.rank} issued "
                   f"{mine!r} and rank {peer} {theirs!r}, which cannot complete each other. "
                   f"Where each rank is: {self._where_each(entries)}. " + MISMATCH_HINT)
        self._diagnosed_for, self._diagnosed_dead, self.diagnosis = number, False, message
        self.report_mismatch(message)

    def _differ(self, number: int, description: str, entry: dict[str, Any]) -> tuple[int, str, str] | None:
        """(the number, this rank's collective, the peer's) where this rank, waiting in ``number``, and the peer of
        ``entry`` issued different collectives under one number: the one they wait in, or, when they wait in
        different ones, the one the other issued among its latest (``recent``: ranks wait in collectives issued
        ahead, so one may wait in #45 while the other, whose #44 never paired, waits in #44)."""
        if entry["number"] == number:
            return None if entry["description"] == description else (number, description, entry["description"])
        theirs = dict(map(tuple, entry.get("recent", ()))).get(number)
        if theirs is not None and theirs != description:
            return number, description, theirs
        mine = dict(self._recent()).get(entry["number"])
        if mine is not None and mine != entry["description"]:
            return entry["number"], mine, entry["description"]
        return None

    def _recent(self) -> list[tuple[int, str]]:
        """This rank's latest ``RECENT`` collectives, (number, description), from its flight recorder."""
        if self.flight is None:
            return []
        return [(e.number, e.tag or e.kind) for e in list(self.flight.entries)[-RECENT:]]

    def _where_each(self, entries: dict[int, dict[str, Any] | None]) -> str:
        """Every rank's collective as ``entries`` (and this rank's state) say, ranks in the same place together:
        "rank 0 at #57 'all-gather of unit left', waiting in it, from train.py:40 in forward; rank 1 ..."."""
        number, description, waiting, _ = state = self.state
        mine: dict[str, Any] = {"number": number, "description": description, "waiting": waiting,
                                "where": self._where[1] if self._where[0] is state else None}
        places: dict[tuple[Any, ...] | None, list[int]] = {}
        for r, e in sorted({**entries, self.rank: mine}.items()):
            place = None if e is None else (e["number"], e["description"], e["waiting"], e.get("where"))
            places.setdefault(place, []).append(r)
        parts = []
        for place, ranks in places.items():
            if place is None:
                parts.append(f"{_ranks(ranks)}: no progress published")
                continue
            n, what, waits, where = place
            parts.append(f"{_ranks(ranks)} at #{n} {what!r}, {'waiting in it' if waits else 'finished it'}"
                         + (f", from {where}" if where else ""))
        return "; ".join(parts)

    def publish_crash(self, error: BaseException) -> None:
        """This rank ends with ``error``: say so in its entry, so that its peers name it crashed, with why."""
        self.crashed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:400]
        self._published = None
        try:
            self._publish()
        except Exception:  # the store is gone or cut off: the peers will name this rank dead or unreachable
            pass

    # ------------------------------------------------------------------ the flight records
    def write_flight(self, reason: str, ask_peers: bool = False) -> None:
        """Write this rank's flight records with ``reason`` and, with ``ask_peers``, ask every other rank to
        write theirs (a key in the store that their monitor threads look for). Never raises."""
        if self.flight is None:
            return
        path = self.flight.write(self.rank, reason)
        if path is not None and not self._flight_logged:  # later writes (the same failure, later) update the file
            self._flight_logged = True
            log.error("rank %d: its last %d collectives are in %s", self.rank, len(self.flight.entries), path)
        if ask_peers:
            text = json.dumps({"rank": self.rank, "reason": reason[:400]})
            try:
                if not self._flight_asked:  # it wrote its own: it counts among the ranks that did
                    self.store.run(lambda store: (store.set(_FLIGHT_KEY, text), store.add(_FLIGHT_ANSWERS, 1)))
                    self._flight_asked = True
                self._await_flight_answers()
            except Exception:  # the store is gone or cut off: each rank still writes on its own failure
                pass

    def _await_flight_answers(self) -> None:
        """Wait up to ``FLIGHT_ANSWER_WAIT_S`` until every rank has written its records (the ranks that asked count
        themselves, the others count their answer): the rank that asked is about to raise, and when it ends the
        launcher stops the others (a rank stuck in its own code would be stopped before its monitor looked). A dead
        rank never answers: then this waits the whole bound."""
        deadline = time.monotonic() + FLIGHT_ANSWER_WAIT_S
        while self.store.run(lambda store: int(store.add(_FLIGHT_ANSWERS, 0))) < self.world_size:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _answer_flight_request(self) -> None:
        """Write this rank's records once another rank asked for every rank's (``write_flight``)."""
        if self.flight is None or self._flight_answered or time.monotonic() - self._flight_checked_at < HEARTBEAT:
            return  # looked for at the heartbeat's pace: one store call a rank every 2 s, at 1,024 ranks too
        self._flight_checked_at = time.monotonic()
        asked = self.store.run(lambda store: store.get(_FLIGHT_KEY) if store.check([_FLIGHT_KEY]) else None)
        if asked is not None:
            self._flight_answered = True
            request = json.loads(asked)
            if request["rank"] != self.rank:
                self.write_flight(f"rank {request['rank']} asked: {request['reason']}")
                self.store.run(lambda store: store.add(_FLIGHT_ANSWERS, 1))

    # ------------------------------------------------------------------ monitor thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                self._learn_peers()
                self._answer_flight_request()
                for work in self.beat_work:
                    work()
            except StoreUnreachable:  # cut off: keep watching the deadline, whose message says so
                pass
            except StoreFailed as exc:  # the store went away (job ending): stop quietly
                log.debug("collective monitor stops: %s", exc)
                return
            try:
                number, description, waiting, since = self.state
                waited = time.time() - since
                if (waiting and waited >= EARLY_LOOK_S and self.mismatch is None
                        and time.monotonic() - self._compared_waits_at >= HEARTBEAT):
                    self._compared_waits_at = time.monotonic()
                    self._compare_waits(number, description)
                if waiting and waited >= self.deadline - PATIENCE and (self._snapshot is None
                                                                       or self._snapshot[0] != number):
                    self._snapshot = (number, time.monotonic(), self._beats(self._read_entries()))
                if waiting and waited >= self.deadline and self._diagnosed_for != number:
                    dead, message = self.explain(number)
                    self._diagnosed_for, self._diagnosed_dead, self.diagnosis = number, dead, message
                    log.error("%s", message)
                    self.write_flight(f"collective #{number} passed the hang deadline: {message}", ask_peers=True)
            except Exception as exc:  # a diagnosis that fails must not end the thread that publishes
                log.debug("collective monitor: diagnosis failed: %s", exc)

    def _publish(self) -> None:
        state = self.state
        where = self._where_of(state)
        if (state, where) != self._published or time.monotonic() - self._published_at >= HEARTBEAT:
            number, description, waiting, since = state
            self._beat += 1
            entry = {"number": number, "description": description, "waiting": waiting, "since": since,
                     "host": self._host, "pid": os.getpid(), "beat": self._beat}
            if where is not None:
                entry["where"] = where
            if waiting:  # what it issued ahead of the wait (``_differ``)
                entry["recent"] = self._recent()
            if self.crashed is not None:
                entry["crashed"] = self.crashed
            text = json.dumps(entry)
            self._published, self._published_at = (state, where), time.monotonic()
            self.store.run(lambda store: store.set(_KEY.format(rank=self.rank), text))

    def _where_of(self, state: tuple[int, str, bool, float]) -> str | None:
        """Where the user's code waits in ``state``'s wait (None where it does not wait, or the wait ended before
        its thread's frames were read): read once for each wait, on this thread (see the module docstring)."""
        if not state[2]:
            return None
        if self._where[0] is not state:
            frame = sys._current_frames().get(self._waiter) if self._waiter is not None else None
            where = user_frame(frame) if frame is not None else None
            del frame
            if self.state is not state:  # the wait ended while its frames were read: they may be another's
                return None
            self._where = (state, where)
        return self._where[1]

    def _learn_peers(self) -> None:
        """Read the peers' entries until each was seen once (their hosts and pids), in a job of at most
        ``LEARN_UP_TO`` ranks (a read of every entry by every rank costs the store the square of the world;
        a larger job names the other nodes' ranks from torchrun's variables), at most ``LEARN_TRIES`` times."""
        if self.world_size <= LEARN_UP_TO and len(self._known) < self.world_size - 1 and self._learn_tries < LEARN_TRIES:
            self._learn_tries += 1
            self._read_entries()

    def _read_entries(self) -> dict[int, dict[str, Any] | None]:
        """Every other rank's published entry (None: nothing published yet). Raises ``StoreUnreachable``
        or ``StoreFailed`` when the store cannot say."""
        keys = {r: _KEY.format(rank=r) for r in range(self.world_size) if r != self.rank}

        def read(store: Any) -> dict[int, dict[str, Any] | None]:
            out: dict[int, dict[str, Any] | None] = {}
            for r, key in keys.items():  # ``get`` of a missing key would wait for it: ask first
                out[r] = json.loads(store.get(key)) if store.check([key]) else None
            return out

        entries = self.store.run(read)
        self._known.update({r: e for r, e in entries.items() if e is not None})
        return entries

    @staticmethod
    def _beats(entries: dict[int, dict[str, Any] | None]) -> dict[int, Any]:
        return {r: e.get("beat") for r, e in entries.items() if e is not None}

    # ------------------------------------------------------------------ the explanation
    def explain_failure(self, reported: str) -> tuple[bool, str]:
        """Why the wait this rank is in failed (``reported``: the process group's words): (whether a rank
        is lost: dead, crashed or unreachable; the message). Called by the waiting thread as the wait
        fails; it returns within a few store bounds and ``PATIENCE``, whatever the store does."""
        number = self.state[0]
        if self.diagnosis is not None and self._diagnosed_for == number:
            dead, message = self._diagnosed_dead, self.diagnosis
        else:
            dead, message = self.explain(number, closed=connection_closed(reported))
        self.write_flight(f"collective #{number} failed ({reported}): {message}", ask_peers=True)
        return dead, message

    def explain(self, number: int, closed: bool = False) -> tuple[bool, str]:
        """Where every rank is while this one waits in collective ``number``, naming the lost ones as
        crashed, dead or unreachable with how that is known (``closed``: the process group saw a peer's
        connection close, so a process ended), and the live ones that never arrived."""
        _, description, _, since = self.state
        where = f"while rank {self.rank} waited in collective #{number} ({description})"
        try:
            entries = self._read_entries()
        except StoreFailed as exc:
            return True, (f"the process that holds the job's key-value store (the launcher, or rank 0 when the job "
                          f"was started without one) died {where}: the store's connection failed ({exc}); look at "
                          "its output for why it ended, then resume from the last checkpoint.")
        except StoreUnreachable:
            return True, self._store_unreachable(where)
        lost = self._crashed(entries)
        lost.update(self._dead_here(entries, {r for r in entries if r not in lost}, wait=PATIENCE if closed else 0.0))
        remote = {r for r, e in entries.items() if e is not None and r not in lost and e.get("host") != self._host}
        if remote:
            lost.update(self._silent(entries, remote, closed))
        if lost:
            return True, (f"{_lost(lost)} {where} for {time.time() - since:.0f} s; the job cannot go on without "
                          "it: look at that rank's output (or the launcher's line) for why, then resume from the "
                          "last checkpoint.")
        return False, self.diagnose(entries, closed=closed)

    def _store_unreachable(self, where: str) -> str:
        here = sorted(r for r, e in self._known.items() if e.get("host") == self._host)
        away = {r: e.get("host", "?") for r, e in self._known.items() if e.get("host") != self._host}
        store = os.environ.get("MASTER_ADDR", "?") + ":" + os.environ.get("MASTER_PORT", "?")
        named = "; ".join(f"rank {r} on {h}" for r, h in sorted(away.items())) or _other_nodes(self.rank,
                                                                                               self.world_size)
        return (f"the node that holds the job's key-value store ({store}) is unreachable from this host "
                f"({self._host}) {where}: the store has given no answer for {self.store.bound:.0f} s or more and "
                f"its connection never closed (a process that ends closes it), so that node is down or cut off "
                f"from this one; unreachable with it: {named}"
                + (f" (ranks {', '.join(map(str, here))} are on this host)" if here else "")
                + ". Check the network between the nodes, then resume from the last checkpoint.")

    def _crashed(self, entries: dict[int, dict[str, Any] | None]) -> dict[int, str]:
        return {r: f"crashed with {e['crashed']} (its last words in the job's store)"
                for r, e in entries.items() if e is not None and e.get("crashed")}

    def _dead_here(self, entries: dict[int, dict[str, Any] | None], ranks: set[int],
                   wait: float = 0.0) -> dict[int, str]:
        """The ranks of ``ranks`` on this host whose process is gone or a zombie. ``wait``: seconds to
        watch the live ones (a connection closed: a killed process closes its sockets a moment before
        it becomes a zombie)."""
        pids = {r: int(e["pid"]) for r, e in entries.items()
                if r in ranks and e is not None and "pid" in e and e.get("host") == self._host}
        dead: dict[int, str] = {}
        end = time.monotonic() + wait
        while True:
            for r, pid in pids.items():
                how = _process_gone(pid) if r not in dead else ""
                if how:
                    dead[r] = f"died (process {pid} on this host {how})"
            if len(dead) == len(pids) or time.monotonic() >= end:
                return dead
            time.sleep(0.1)

    def _silent(self, entries: dict[int, dict[str, Any] | None], ranks: set[int], closed: bool) -> dict[int, str]:
        """The ranks of ``ranks`` (elsewhere) whose heartbeat did not advance for ``PATIENCE`` seconds: dead
        when the process group saw a connection close, unreachable when none did."""
        beats, seen_at = self._beats(entries), time.monotonic()
        snap = self._snapshot
        if snap is not None and snap[0] == self.state[0] and seen_at - snap[1] >= PATIENCE - 0.5:
            before, since = snap[2], snap[1]
        else:  # no reading old enough: wait for one
            before, since = beats, seen_at
            time.sleep(PATIENCE)
            try:
                beats = self._beats(self._read_entries())
            except (StoreUnreachable, StoreFailed):
                return {}
            seen_at = time.monotonic()
        quiet = seen_at - since
        lost: dict[int, str] = {}
        for r in ranks:
            if r not in before or beats.get(r) != before[r]:
                continue
            e = entries[r] or {}
            who = f"process {e.get('pid')} on {e.get('host')}"
            if closed:
                lost[r] = (f"died ({who}: the process group saw a connection close and its heartbeat stopped "
                           f"{quiet:.0f} s ago)")
            else:
                lost[r] = (f"is unreachable ({who}: no heartbeat for {quiet:.0f} s and no connection closed, as a "
                           f"process that ends closes them: its node is down or cut off from this one)")
        return lost

    def diagnose(self, entries: dict[int, dict[str, Any] | None] | None = None, closed: bool = False) -> str:
        """Who never arrived at the collective this rank waits in, and where every rank is (``entries``:
        as read; read here when None)."""
        number, description, _, since = self.state
        now = time.time()
        if entries is None:
            entries = self._read_entries()
        # a rank of this host whose process is stopped is named as such wherever its entry says it is: a rank
        # stopped inside the collective (its main thread published the wait, then a signal or a debugger held
        # the process) blocks it as surely as one that never came, yet would read as "waiting in it as well"
        here = {r: e for r, e in entries.items() if e is not None and e.get("host") == self._host and "pid" in e}
        stopped = {r: (e, how) for r, e in here.items() if (how := _process_stopped(int(e["pid"])))}
        moving = {r: e for r, e in entries.items() if r not in stopped}
        behind = {r: e for r, e in moving.items() if e is None or e["number"] < number}
        waiting_too = sorted(r for r, e in moving.items() if e is not None and e["number"] == number and e["waiting"])
        elsewhere = {r: e for r, e in moving.items() if e is not None and e["number"] > number}
        lines = [f"collective #{number} ({description}) has waited {now - since:.0f} s on rank {self.rank}."]
        if closed:
            lines.append("A peer's connection closed (the process group says so), yet every rank that published "
                         "its progress is alive.")
        if stopped:
            lines.append("These ranks are stopped, and the collective cannot complete until they go on: " + "; ".join(
                f"rank {r} (its process {e['pid']} {how}; {_last_collective(e, now)})"
                for r, (e, how) in sorted(stopped.items())) + ". Let them continue (SIGCONT, or detach the debugger), "
                "or end the job and resume from the last checkpoint.")
        if behind:
            parts = [f"rank {r} (no progress published: it may have died or never started)" if e is None
                     else f"rank {r} ({_last_collective(e, now)})" for r, e in sorted(behind.items())]
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


def _last_collective(entry: dict[str, Any], now: float) -> str:
    """Where a rank's entry says it is: "its last collective is #N, what it moves, waiting in it" (or finished)."""
    state = "waiting in it" if entry["waiting"] else f"finished {now - entry['since']:.0f} s ago"
    where = f", from {entry['where']}" if entry.get("where") else ""
    return f"its last collective is #{entry['number']}, {entry['description']}, {state}{where}"


def _ranks(ranks: list[int]) -> str:
    """"rank 3", "ranks 0, 2-5" (runs of consecutive ranks as ranges)."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


#: how a frame's file counts when naming where a collective waits from (``user_frame``)
_INTERNAL, _LIBRARY, _USER = 0, 1, 2
#: file name -> how it counts, learnt as frames are met (a file is classified once)
_file_kinds: dict[str, int] = {}
_prefixes: tuple[tuple[str, ...], tuple[str, ...]] | None = None
_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _kind_of(filename: str) -> int:
    """Whether ``filename`` is xshard's or torch's (internal), the standard library's or an installed
    package's (library), or the user's."""
    global _prefixes
    if _prefixes is None:
        import sysconfig

        here = os.path.dirname(os.path.abspath(__file__))
        internal = {here}  # backends/, however it was reached (xshard/backends is a link to it)
        for module in ("xshard", "torch"):
            loaded = sys.modules.get(module)
            where = getattr(loaded, "__file__", None) if loaded is not None else None
            if where:
                internal.add(os.path.dirname(os.path.abspath(where)))
        internal |= {os.path.realpath(d) for d in internal}
        paths = sysconfig.get_paths()
        library = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
        library |= {os.path.realpath(d) for d in library}
        _prefixes = (tuple(d.rstrip(os.sep) + os.sep for d in internal),
                     tuple(d.rstrip(os.sep) + os.sep for d in library) + ("<frozen",))
    internal_dirs, library_dirs = _prefixes
    if filename.startswith(internal_dirs):
        return _INTERNAL
    if filename.startswith(library_dirs) or any(f"{os.sep}{d}{os.sep}" in filename for d in _PACKAGE_DIRS):
        return _LIBRARY
    return _USER


def user_frame(frame: Any) -> str | None:
    """Where the user's code is in the stack that ``frame`` ends: "train.py:42 in main" for the innermost frame
    that is neither xshard's, torch's, the standard library's nor an installed package's (failing that, the
    innermost that is neither xshard's nor torch's; None where every frame is theirs). The file is named
    relative to the working directory when it lies under it."""
    fallback = None
    while frame is not None:
        code = frame.f_code
        kind = _file_kinds.get(code.co_filename)
        if kind is None:
            kind = _file_kinds[code.co_filename] = _kind_of(code.co_filename)
        if kind == _USER:
            break
        if kind == _LIBRARY and fallback is None:
            fallback = frame
        frame = frame.f_back
    frame = frame if frame is not None else fallback
    if frame is None:
        return None
    path = frame.f_code.co_filename
    try:
        relative = os.path.relpath(path)
        path = relative if not relative.startswith(os.pardir) else path
    except ValueError:  # another drive (Windows), or no file
        pass
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _other_nodes(rank: int, world_size: int) -> str:
    """The ranks of the other nodes, from torchrun's variables (a node's ranks are consecutive)."""
    try:
        first = rank - int(os.environ["LOCAL_RANK"])
        here = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return "the ranks of the other nodes"
    away = [r for r in range(world_size) if r not in here]
    shown = ", ".join(map(str, away[:16])) + (f" ... ({len(away)} in all)" if len(away) > 16 else "")
    return (f"rank{'s' if len(away) > 1 else ''} {shown}") if away else "the ranks of the other nodes"


def store_bound(timeout: float) -> float:
    """How long one store call of the diagnosis may wait for its answer: a fifth of the job's timeout,
    between 2 and 10 s."""
    return min(10.0, max(2.0, 0.2 * timeout))


#: the process group's words when a peer's socket closed (its process ended): gloo's, and the kernel's
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection reset")


def connection_closed(reported: str) -> bool:
    """Does the process group's error say a peer's connection closed (rather than a timeout)?"""
    text = reported.lower()
    return any(words in text for words in _CLOSED)


_hook_installed = False


def _report_crashes() -> None:
    """Once per process: an exception that ends the script is published in this rank's entry (every
    running monitor's) before the interpreter exits, so that the peers name the rank crashed, with why."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        for monitor in list(_running):
            monitor.publish_crash(error)
            monitor.write_flight(f"this rank's script ended with {monitor.crashed}", ask_peers=True)
        leave_for_the_launcher(error, tb)  # the launcher names this rank's exception
        previous(kind, error, tb)

    sys.excepthook = hook
    _answer_sigusr1()


def _answer_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes the process's flight records (when its main thread runs Python: a rank blocked
    in a collective writes them when another rank's failure asks). Only where nothing else answers SIGUSR1."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
        return

    def write(signum: int, frame: Any) -> None:
        for monitor in list(_running):
            monitor.write_flight("asked with SIGUSR1")

    signal.signal(signal.SIGUSR1, write)


def _lost(lost: dict[int, str]) -> str:
    return "; ".join(f"rank {r} {how}" for r, how in sorted(lost.items()))


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


def _process_stopped(pid: int) -> str:
    """"is stopped (...)" for a process of this host that a signal or a debugger stopped, "" otherwise."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return "is stopped (SIGSTOP, or a debugger holds it)" if state in ("T", "t") else ""
