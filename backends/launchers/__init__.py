"""Launchers: how `xshard launch` starts a job's processes, one class per kind.

``Backend.launcher()`` returns the launcher object for its backend:

- ``TorchrunLauncher`` (cpu, cuda, npu; the default): torchrun, N processes per node, several nodes;
- ``XLALauncher`` (xla): torch_xla's ``xmp.spawn``, one process per local chip, on every host;
- ``SingleLauncher`` (mps): one process.

All of them tie every process they start to the launcher (``parent_death``): a launcher that is
killed, even with SIGKILL, takes its ranks with it.
"""

from __future__ import annotations

from .base import Launcher, LaunchError, LaunchPlan, LaunchRequest, exit_code, run_child
from .single import SingleLauncher
from .torchrun import TorchrunLauncher

__all__ = [
    "LaunchError",
    "LaunchPlan",
    "LaunchRequest",
    "Launcher",
    "SingleLauncher",
    "TorchrunLauncher",
    "XLALauncher",
    "exit_code",
    "run_child",
]


def __getattr__(name: str) -> type:
    """``XLALauncher`` on first use (its module imports the xla backend module)."""
    if name == "XLALauncher":
        from .xla import XLALauncher

        return XLALauncher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
