"""The flight recorder: each rank's last collectives, written down when the job hangs, crashes or is asked.

Every collective a process issues is an entry here (its number, kind, tag, group, bytes, and the wall-clock
times it was issued, waited for and ended); the last ``XSHARD_FLIGHT_RECORDS`` (1,000) are kept. NCCL's
flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``) does this for NCCL alone; this one is the same on every
backend, and it names collectives as xshard does ("all-gather of unit layers.3").

When the records are written (``backends.diagnostics.monitor``, which holds each job's recorder): a wait that fails (a
timeout, a lost peer) or that passes the hang deadline, and a script that ends with an exception, write this
rank's records and ask every other rank, through the job's key-value store, to write theirs (each rank's
monitor thread looks for the request every 2 s, so a rank stuck in its own code, or blocked in a
collective, writes too; the rank that asked waits up to 3.5 s for every rank's answer before it raises, since its
end makes the launcher stop the others). ``kill -USR1 <pid>`` writes a rank's records when its main thread runs Python.

Where: ``XSHARD_FLIGHT_DIR`` (``xshard launch`` sets it to a folder of its own and names it when the job
fails), else ``<tmp>/xshard-flight-<job id>``; one JSON file per rank, ``rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

DIR_ENV = "XSHARD_FLIGHT_DIR"
KEEP_ENV = "XSHARD_FLIGHT_RECORDS"
DEFAULT_KEEP = 1000


class FlightEntry:
    """One collective as issued, and when its wait started and ended (None: not yet)."""

    __slots__ = ("number", "kind", "tag", "group", "nbytes", "issued", "wait_started", "ended")

    def __init__(self, number: int, kind: str, tag: str | None, group: str, nbytes: int) -> None:
        self.number, self.kind, self.tag, self.group, self.nbytes = number, kind, tag, group, nbytes
        self.issued = time.time()
        self.wait_started: float | None = None
        self.ended: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The entry as the written record has it."""
        return {name: getattr(self, name) for name in self.__slots__}


class FlightRecorder:
    """The last ``keep`` collectives of one job's books (``Collectives``)."""

    def __init__(self, keep: int | None = None) -> None:
        self.keep = keep if keep is not None else max(1, int(os.environ.get(KEEP_ENV, DEFAULT_KEEP)))
        self.entries: deque[FlightEntry] = deque(maxlen=self.keep)

    def issue(self, number: int, kind: str, tag: str | None, group: str, nbytes: int) -> FlightEntry:
        """Record collective ``number`` as issued now; its handle marks its wait on the returned entry."""
        entry = FlightEntry(number, kind, tag, group, nbytes)
        self.entries.append(entry)
        return entry

    def records(self) -> list[dict[str, Any]]:
        """Every kept entry, oldest first (a copy: safe to take from another thread while collectives run)."""
        return [entry.as_dict() for entry in list(self.entries)]

    def write(self, rank: int, reason: str) -> Path | None:
        """Write this rank's records, with ``reason``, to ``flight_dir()/rank<R>.json``; the path, or None where
        the folder cannot be written (never raises: it runs while a job fails)."""
        records = self.records()
        in_flight = [r for r in records if r["ended"] is None]
        data = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
                "written": time.time(), "in_flight": in_flight, "records": records}
        try:
            folder = flight_dir()
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank{rank}.json"
            part = path.with_name(f".{path.name}.{os.getpid()}.part")
            part.write_text(json.dumps(data, indent=1))
            os.replace(part, path)
            return path
        except OSError:
            return None


def flight_dir() -> Path:
    """Where ranks write their records: ``XSHARD_FLIGHT_DIR``, else a folder in the temporary directory named
    after the job (torchrun's run id, else this process)."""
    given = os.environ.get(DIR_ENV)
    if given:
        return Path(given)
    job = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"xshard-flight-{job}"
