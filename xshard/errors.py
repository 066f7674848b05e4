"""xshard's errors: the root ``XShardError`` and the errors a user sees from the device layer.

The leaf of the import graph: every layer (the device layer ``xshard.backends``, the sharded core,
checkpoints, config, the CLI) imports its errors from here and nothing here imports xshard. Each
error's message names the problem and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


class XShardError(Exception):
    """Base of xshard's user-facing errors (the CLI prints the message and exits non-zero)."""

    exit_code = 2


class UnknownBackendError(XShardError, ValueError):
    """XSHARD_BACKEND or backend= names no known backend."""


class BackendUnavailableError(XShardError, RuntimeError):
    """A backend was asked for explicitly but cannot run here (missing package, driver or device)."""


class BackendConflictError(XShardError, ValueError):
    """The backend= argument in code contradicts XSHARD_BACKEND in the environment."""


class WorldSizeError(XShardError, RuntimeError):
    """The job has more processes than the backend can run (MPS: one)."""


class VisibleDevicesError(XShardError, ValueError):
    """The ``devices`` option is malformed, or cannot take effect (runtime started, or a conflicting
    visible-devices variable is already exported)."""


class WorldEnvironmentError(XShardError, ValueError):
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) are malformed or inconsistent."""


class CollectiveMismatchError(XShardError, RuntimeError):
    """Ranks issued different collectives (data-dependent control flow across sharded units)."""


class CollectiveTimeoutError(XShardError, RuntimeError):
    """A collective waited past the process-group timeout (or a peer died in it); the message names the
    ranks that never arrived and where every rank was."""


class RankDiedError(XShardError, RuntimeError):
    """A peer process died (killed, crashed, its node lost) while this rank waited in a collective; the
    message names the dead rank(s) and the collective this rank waited in."""


class OtherRankFailedError(XShardError, RuntimeError):
    """This rank's own part was fine, but another rank's failed, so every rank stops: the message names that rank
    (``because_of``), and the launcher names it as the rank that failed (``culprit_rank``)."""


#: the phrase a "failed because of another rank" message carries, for the launcher to read back
_CULPRIT = re.compile(r"\bbecause ranks? (\d+)(?:, \d+)*(?: and \d+ more)? failed\b")


def because_of(ranks: Sequence[int], count: int) -> str:
    """"because rank 1 failed" / "because ranks 1, 3 failed": the ``count`` ranks that failed, ``ranks`` the ones
    known by number (the lowest first; a rank past the agreement's bitmask is counted, not named)."""
    named = sorted(ranks)
    if not named:
        return f"because {count} other rank(s) failed"
    more = f" and {count - len(named)} more" if count > len(named) else ""
    word = "rank" if len(named) == 1 and not more else "ranks"
    return f"because {word} {', '.join(map(str, named))}{more} failed"


def culprit_rank(message: str) -> int | None:
    """The first rank a ``because_of`` phrase in ``message`` names, or None."""
    found = _CULPRIT.search(message)
    return int(found.group(1)) if found else None
