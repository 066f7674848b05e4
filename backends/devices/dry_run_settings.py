"""What a dry run asks of a job (``xshard launch --dry-run``): where its report goes, how many optimizer steps it
takes, the target device's memory. Set by ``xshard.cli.dry_run`` in the environment of the one process it
starts; read through ``Backend.dry_run()``, which only the dry run's backend (``dry_run_backend.py``) answers."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: the variables of a dry run
REPORT_ENV = "XSHARD_DRY_RUN"
STEPS_ENV = "XSHARD_DRY_RUN_STEPS"
DEVICE_MEMORY_ENV = "XSHARD_DRY_RUN_DEVICE_MEMORY"
#: optimizer steps a dry run takes by default: the first warms up, the second is measured
DEFAULT_STEPS = 2


@dataclass(frozen=True)
class DryRunSettings:
    """Where the report goes, the optimizer steps to take (the last one's collectives are reported), the target
    device's memory in bytes (None: not given)."""

    report_path: str
    steps: int = DEFAULT_STEPS
    device_memory: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DryRunSettings | None:
        """The settings ``xshard.cli.dry_run`` put into this process's environment; None outside a dry run."""
        env = os.environ if env is None else env
        path = env.get(REPORT_ENV)
        if not path:
            return None
        memory = env.get(DEVICE_MEMORY_ENV)
        return cls(path, max(1, int(env.get(STEPS_ENV, DEFAULT_STEPS))), int(float(memory)) if memory else None)
