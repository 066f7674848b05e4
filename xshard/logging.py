"""``from xshard.logging import get_logger``: Accelerate's ``accelerate.logging`` import path.

The logger takes Accelerate's ``main_process_only`` and ``in_order`` keywords; ``xshard.runtime.rank_logging``
describes the per-process levels and the rank prefix it follows.
"""

from __future__ import annotations

from .runtime.rank_logging import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
