"""The collective trace: what this process issued, numbered and fingerprinted, and the mismatch message.

Every call may carry a ``tag`` naming what it moves (e.g. "all-gather of unit layers.3"). Calls are
numbered and fingerprinted (``CollectiveTrace``), so ``verify_same_collectives`` can tell whether every
rank issued the same collectives since the last check (with one tiny all-reduce at the first optimizer
step, later off the training path: ``agreement.py``), and name the first one where they differ
(``describe_mismatch``, over the ranks' entries).
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any

from ..diagnostics.monitor import MISMATCH_HINT


class CollectiveTrace:
    """What this process issued since the last ``reset``: a count, a fingerprint, the latest entries.

    The fingerprint chains a CRC of every entry (kind, tag, elements), so two ranks that issued the
    same collectives in the same order have the same (count, fingerprint). Only the last ``keep``
    entries are kept as text, for error messages (a long evaluation without checks stays bounded).
    """

    def __init__(self, keep: int = 512) -> None:
        self.count = 0
        self.fingerprint = 0
        self.entries: deque[str] = deque(maxlen=keep)

    def record(self, kind: str, tag: str | None, numel: int) -> None:
        entry = f"{tag or kind} ({numel} elements)"
        self.count += 1
        self.fingerprint = zlib.crc32(entry.encode(), self.fingerprint)
        self.entries.append(entry)

    def reset(self) -> None:
        self.count = 0
        self.fingerprint = 0
        self.entries.clear()

    def take(self) -> tuple[int, int, deque[str]]:
        """(count, fingerprint, the kept entries) since the last reset, then start anew.

        The entries leave with the caller (a fresh deque replaces them), so a step's list can be
        kept for a mismatch message without copying it on the training path (``number`` them later).
        """
        count, fingerprint, entries = self.count, self.fingerprint, self.entries
        self.count, self.fingerprint = 0, 0
        self.entries = deque(maxlen=entries.maxlen)
        return count, fingerprint, entries

    def numbered(self) -> list[tuple[int, str]]:
        """The kept entries with their 1-based numbers since the last reset."""
        return number(self.count, self.entries)



def number(count: int, entries: deque[str]) -> list[tuple[int, str]]:
    """The last ``len(entries)`` of ``count`` collectives, with their 1-based numbers."""
    first = count - len(entries) + 1
    return [(first + i, e) for i, e in enumerate(entries)]


#: how to fix a mismatch (the hang diagnosis names one too, so the text lives beside it)
_MISMATCH_HINT = MISMATCH_HINT


def describe_mismatch(traces: dict[int, dict[str, Any]]) -> str:
    """The first collective (by number since the last check) at which ranks' entries differ."""
    by_number = {r: dict(map(tuple, t["entries"])) for r, t in traces.items()}
    counts = {r: t["count"] for r, t in traces.items()}
    for n in range(1, max(counts.values()) + 1):
        seen = {r: by_number[r].get(n, "nothing (it issued fewer collectives)" if n > counts[r] else None)
                for r in traces}
        known = {r: v for r, v in seen.items() if v is not None}
        if len(known) == len(seen) and len(set(known.values())) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in sorted(known.items()):
                groups.setdefault(v, []).append(r)
            parts = [f"{_ranks(rs)} issued {v!r}" for v, rs in groups.items()]
            return (f"ranks issued different collectives since the last optimizer step: at collective #{n}, "
                    + "; ".join(parts) + ".")
    totals = ", ".join(f"rank {r}: {c}" for r, c in sorted(counts.items()))
    return f"ranks issued different collectives since the last optimizer step (counts {totals})."


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
