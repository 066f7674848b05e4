"""How ``xshard launch`` learns whether its job ran on xshard at all.

The launcher names a folder in ``XSHARD_LAUNCH_MARKERS``; each process that starts to build an
xshard ``Accelerator`` leaves an empty file there, first thing, so that a job whose Accelerator
refused its settings (a bad ``XSHARD_STAGE``) still counts as run on xshard: that error is xshard's
own and already said. A job that ends with the folder empty never used xshard (a script on stock
Accelerate or the stock Trainer), and the launcher says so.

A job can also fail inside xshard's code before any Accelerator was built (a plugin class of
``xshard.utils`` refusing its arguments): ``import xshard`` chains ``sys.excepthook`` in the launched
processes (``watch_for_failures``), and a process whose uncaught exception passed through xshard's
package leaves a second kind of mark naming the innermost such frame, so that the launcher names
xshard's code instead of saying that xshard had no part in the failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType

MARKER_ENV = "XSHARD_LAUNCH_MARKERS"
#: the mark of a process that started to build an Accelerator, and of one that failed in xshard's code
BUILT_PREFIX, FAILED_PREFIX = "pid-", "failed-"
#: xshard's package, and the device layer it links to (``xshard/backends`` is a link to ``backends/``)
_PACKAGE = Path(__file__).resolve().parent.parent
_ROOTS = (_PACKAGE, (_PACKAGE / "backends").resolve())


def mark_accelerator_built() -> None:
    """Leave this process's mark, when ``xshard launch`` asked for marks (never fails the job)."""
    folder = os.environ.get(MARKER_ENV)
    if not folder:
        return
    try:
        (Path(folder) / f"{BUILT_PREFIX}{os.getpid()}").touch()
    except OSError:
        pass  # a mark that cannot be written costs a wrong hint at the end, never the run


def accelerator_was_built(folder: str | os.PathLike) -> bool:
    """Did any process of the job leave its mark in ``folder``?"""
    try:
        return any(path.name.startswith(BUILT_PREFIX) for path in Path(folder).iterdir())
    except OSError:
        return False


def failed_in_xshard(folder: str | os.PathLike) -> str | None:
    """The frame of xshard's code a process of the job failed in (``path:line in function``), or None."""
    try:
        marks = sorted(path for path in Path(folder).iterdir() if path.name.startswith(FAILED_PREFIX))
        if not marks:
            return None
        return marks[0].read_text().strip() or None
    except OSError:
        return None


def xshard_frame(error: BaseException) -> str | None:
    """The innermost frame of xshard's package in ``error``'s traceback, or in the exceptions it was raised
    from or while handling (as Python prints them), as ``xshard/path.py:line in function``; None if none."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = None
        tb: TracebackType | None = current.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            where = _in_package(code.co_filename)
            if where is not None:
                found = f"{where}:{tb.tb_lineno} in {code.co_name}"
            tb = tb.tb_next
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


def _in_package(filename: str) -> str | None:
    """``filename`` as a path inside xshard (``xshard/...`` or ``backends/...``), or None outside it."""
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return None
    for root in _ROOTS:
        if path.is_relative_to(root):
            return str(Path(root.name) / path.relative_to(root))
    return None


def watch_for_failures() -> None:
    """Under ``xshard launch``: chain ``sys.excepthook`` so that an uncaught exception raised through xshard's
    code leaves this process's failure mark (the module docstring); elsewhere, or a second time, nothing."""
    folder = os.environ.get(MARKER_ENV)
    if not folder or getattr(sys.excepthook, "xshard_watch", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        try:
            frame = xshard_frame(error)
            if frame is not None:
                (Path(folder) / f"{FAILED_PREFIX}{os.getpid()}").write_text(frame + "\n")
        except Exception:  # noqa: BLE001 (a mark that cannot be written costs a wrong hint, never the report)
            pass
        previous(kind, error, tb)

    hook.xshard_watch = True  # type: ignore[attr-defined]
    sys.excepthook = hook
