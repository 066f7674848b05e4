"""Accelerate's ``accelerate.utils`` import path: re-exports ``xshard.accelerate_compat.utils``.

Its public names: ``set_seed``, ``ProjectConfiguration``, the ``*Kwargs`` and plugin classes ... (listed in that module's ``__all__``).
"""

from .accelerate_compat.utils import *  # noqa: F403
