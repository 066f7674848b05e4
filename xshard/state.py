"""Accelerate's ``accelerate.state`` import path: re-exports ``xshard.accelerate_compat.accelerator_state``.

Its public names: ``AcceleratorState``, ``GradientState``, ``DistributedType`` ... (listed in that module's ``__all__``).
"""

from .accelerate_compat.accelerator_state import *  # noqa: F403
