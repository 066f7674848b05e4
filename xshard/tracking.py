"""Accelerate's ``accelerate.tracking`` import path: re-exports ``xshard.accelerate_compat.tracking``.

Its public names: the trackers and ``TrackerError`` (listed in that module's ``__all__``).
"""

from .accelerate_compat.tracking import *  # noqa: F403
