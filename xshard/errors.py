"""xshard's errors: the root ``XShardError`` and the errors a user sees from the device layer.

The leaf of the import graph: every layer (the device layer ``xshard.backends``, the sharded core,
checkpoints, config, the CLI) imports its errors from here and nothing here imports xshard. Each
error's message names the problem and the fix.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import ClassVar

#: set by ``xshard launch`` for its processes: an uncaught error of a value the user set (``one_line``) ends the
#: process with its one line, no traceback, and reaches the launcher's last line (``report_uncaught_in_one_line``)
ONE_LINE_ENV = "XSHARD_ONE_LINE_ERRORS"


class XShardError(Exception):
    """Base of xshard's user-facing errors (the CLI prints the message and exits non-zero)."""

    exit_code = 2
    #: a value the user set is wrong (a config key, an environment variable, an argument): its message is the
    #: whole story, so the processes of ``xshard launch`` print it as one line, without a traceback
    one_line: ClassVar[bool] = False


class UnknownBackendError(XShardError, ValueError):
    """XSHARD_BACKEND or backend= names no known backend."""

    one_line = True


class BackendUnavailableError(XShardError, RuntimeError):
    """A backend was asked for explicitly but cannot run here (missing package, driver or device)."""


class BackendConflictError(XShardError, ValueError):
    """The backend= argument in code contradicts XSHARD_BACKEND in the environment."""


class WorldSizeError(XShardError, RuntimeError):
    """The job has more processes than the backend can run (MPS: one)."""


class VisibleDevicesError(XShardError, ValueError):
    """The ``devices`` option is malformed, or cannot take effect (runtime started, or a conflicting
    visible-devices variable is already exported)."""

    one_line = True


class WorldEnvironmentError(XShardError, ValueError):
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) are malformed or inconsistent."""

    one_line = True


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


def report_uncaught_in_one_line(environ: Mapping[str, str] = os.environ) -> None:
    """In a process of ``xshard launch`` (``ONE_LINE_ENV`` set): chain ``sys.excepthook`` so that an uncaught
    ``one_line`` error prints ``Type: message`` once, without its traceback, and is left where torchrun's agent
    reads a worker's error (``TORCHELASTIC_ERROR_FILE``), so that the launcher's last line carries the cause.
    Any other exception, and every process outside the launcher, keeps Python's traceback. Once per process."""
    if environ.get(ONE_LINE_ENV) != "1" or getattr(sys.excepthook, "xshard_one_line", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not getattr(error, "one_line", False):
            previous(kind, error, tb)
            return
        leave_for_the_launcher(error, environ=environ)
        # one write of the whole line: the ranks share the launcher's stderr, and print() writes the message and
        # its newline apart, so two ranks' lines could run together
        sys.stderr.write(f"xshard: error: {error}\n")
        sys.stderr.flush()
        # the hooks below still run (launch_marker's: the mark of a failure in xshard's code, read from the
        # traceback), but what they print, Python's own traceback at the end of the chain, is not shown
        shown, sys.stderr = sys.stderr, open(os.devnull, "w")  # noqa: SIM115 (closed below)
        try:
            previous(kind, error, tb)
        finally:
            sys.stderr.close()
            sys.stderr = shown

    hook.xshard_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def leave_for_the_launcher(error: BaseException, tb: TracebackType | None = None,
                           environ: Mapping[str, str] = os.environ) -> None:
    """Write the exception that ends this process where torchrun's agent reads a worker's error
    (``TORCHELASTIC_ERROR_FILE``, in the format of torch's ``ErrorHandler``: its first line as the message, the
    traceback ``tb`` as the call stack, none without it), unless something wrote there already: the launcher then
    names the rank's exception (``backends.launchers.torchrun.failure_report``)."""
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    import traceback

    first = str(error).splitlines()[0] if str(error) else ""
    stack = "".join(traceback.format_exception(type(error), error, tb)) if tb is not None else ""
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": f"{type(error).__name__}: {first}", "extraInfo": {
                "py_callstack": stack, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


report_uncaught_in_one_line()  # the first xshard error class imported in a launched process sets it up
