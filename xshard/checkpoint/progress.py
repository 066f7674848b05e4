"""Progress bars for slow file work: saving, loading and consolidating checkpoints, sharded loading.

A bar is drawn by the main process only, only on a terminal (``xshard.runtime.rank_logging.progress``), and only
once the operation has run for ``SLOW_AFTER_S`` seconds: a quick save of a small model prints
nothing, a multi-GB one shows how far it got and how fast it goes.
"""

from __future__ import annotations

from typing import Any

from ..runtime.rank_logging import progress

#: seconds an operation runs before its bar appears
SLOW_AFTER_S = 3.0


def slow_progress(desc: str, total: int | None = None, unit: str = "B") -> Any:
    """A tqdm bar for a slow operation (bytes by default; ``unit="tensor"`` counts items)."""
    scaled = unit == "B"
    return progress(total=total, desc=desc, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
                    delay=SLOW_AFTER_S, dynamic_ncols=True)
