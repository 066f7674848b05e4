"""Accelerate's ``accelerate.state`` import path: re-exports ``xshard.accelerate_compat.state``.

Its public names: ``AcceleratorState``, ``GradientState``, ``DistributedType`` ... (listed in that module's ``__all__``).
"""

from .accelerate_compat.state import *  # noqa: F403
