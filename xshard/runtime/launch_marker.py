"""How ``xshard launch`` learns whether its job ran on xshard at all.

The launcher names a folder in ``XSHARD_LAUNCH_MARKERS``; each process that starts to build an
xshard ``Accelerator`` leaves an empty file there, first thing, so that a job whose Accelerator
refused its settings (a bad ``XSHARD_STAGE``) still counts as run on xshard: that error is xshard's
own and already said. A job that ends with the folder empty never used xshard (a script on stock
Accelerate or the stock Trainer), and the launcher says so.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKER_ENV = "XSHARD_LAUNCH_MARKERS"


def mark_accelerator_built() -> None:
    """Leave this process's mark, when ``xshard launch`` asked for marks (never fails the job)."""
    folder = os.environ.get(MARKER_ENV)
    if not folder:
        return
    try:
        (Path(folder) / f"pid-{os.getpid()}").touch()
    except OSError:
        pass  # a mark that cannot be written costs a wrong hint at the end, never the run


def accelerator_was_built(folder: str | os.PathLike) -> bool:
    """Did any process of the job leave its mark in ``folder``?"""
    try:
        return any(Path(folder).iterdir())
    except OSError:
        return False
