"""Run a user's script on real torch_xla (XLA:CPU) from the repository root, as the docs give its command.

Shared by the single-device and the two-device files of the users' scripts (``test_xla_users_scripts*.py``),
which the suite splits so that its two workers each take one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from support.xla_replicas import run_command

ROOT = Path(__file__).resolve().parents[2]
#: the environment that puts a script on XLA:CPU
XLA_ENV = {"XSHARD_BACKEND": "xla", "PJRT_DEVICE": "CPU"}


def run_script(cmd: list[str], env: dict[str, str], timeout: int = 270) -> str:
    """``cmd``'s stdout, run from the repository root with ``env`` over this environment, once; it must succeed."""
    proc = run_command(cmd, {**os.environ, **env}, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def epoch_losses(output: str) -> list[float]:
    """The losses examples/minimal.py prints, one per epoch."""
    return [float(m) for m in re.findall(r"epoch \d+: loss ([0-9.]+)", output)]


def env_the_launcher_decides() -> dict[str, str]:
    """This process's environment without the variables `xshard launch` sets for its replicas unless exported
    (``cpu_replicas_env``, ``Backend.default_env``), so the launcher's own choices are what runs."""
    return {k: v for k, v in os.environ.items()
            if k not in ("CPU_NUM_DEVICES", "XLA_THREAD_POOL_SIZE", "PJRT_CPU_ASYNC_CLIENT", "USE_TORCH_XLA")}
