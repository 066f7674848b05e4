"""The ``xshard.metrics`` import path: re-exports ``xshard.accelerate_compat.metrics``.

Its public names: ``split_between_processes``, ``pad_across_processes`` ... (listed in that module's ``__all__``).
"""

from .accelerate_compat.metrics import *  # noqa: F403
