"""A launcher started inside a launcher: refused in one line naming the fix, before any process starts.

Two shapes are seen from the launcher's own process:

- ``xshard launch`` run by a process of a running job (a program that calls it, or a shell inside
  ``torchrun``/``xshard launch``): torchrun's contract sets ``TORCHELASTIC_RUN_ID`` and ``LOCAL_RANK`` in
  every process it starts, and ``xshard launch`` sets ``XSHARD_LAUNCH_MARKERS`` in its own. A second
  launcher there starts a job of its own in each of the job's processes (N x N processes), or, where the
  inner launchers share a rendezvous port (Accelerate's default 29500), waits for peers that never come.
- the program given to ``xshard launch`` is itself a launcher (``trl``, ``accelerate``, ``torchrun``,
  ``deepspeed``, ``llamafactory-cli``, ``xshard``; as a command name, its console script or ``-m``): each of
  the job's processes would start a job of its own.

What is not seen here: a program that starts a launcher from its own code (``subprocess``, Accelerate's
``notebook_launcher``) only does so once it runs, and torchrun and Accelerate do not look for a running job.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from xshard.backends.launchers import LaunchError
from xshard.runtime.launch_marker import MARKER_ENV

__all__ = ["refuse_launcher_program", "refuse_nested_launch"]

#: set in every process torchrun (and so xshard launch) starts
_JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", MARKER_ENV)

_TRL = ("TRL's CLI starts its own `accelerate launch`: run TRL's script on xshard's processes with no edit, "
        "`xshard launch --trainer --nproc N -m trl.scripts.sft ARGS` (dpo, grpo, ...: trl.scripts.<command>)")
_ACCELERATE = ("`accelerate launch` is a launcher: give xshard launch the script it would run (`xshard launch "
               "--nproc N train.py ARGS`; accelerate's --num_processes, --config_file and --mixed_precision work "
               "as they are)")
_TORCHRUN = "torchrun is a launcher: give xshard launch the script it would run (`xshard launch --nproc N train.py ARGS`)"
_DEEPSPEED = ("the deepspeed launcher starts its own processes: give xshard launch the script and the ds_config "
              "(`xshard launch --nproc N --config ds_config.json train.py ARGS`)")
_LLAMAFACTORY = ("`llamafactory-cli train` starts torchrun itself on several devices: run its training entry with "
                 "no edit, `xshard launch --trainer --nproc N -m llamafactory.launcher config.yaml` (its "
                 "`deepspeed:` key replaced by xshard launch's --config)")
_XSHARD = "xshard launch inside xshard launch: give the outer one the script (`xshard launch --nproc N train.py ARGS`)"

#: console-script names and the modules behind them -> the fix
_COMMANDS = {"trl": _TRL, "accelerate": _ACCELERATE, "torchrun": _TORCHRUN, "deepspeed": _DEEPSPEED,
             "llamafactory-cli": _LLAMAFACTORY, "lmf": _LLAMAFACTORY, "xshard": _XSHARD}
_MODULES = {"trl": _TRL, "trl.cli": _TRL, "trl.cli.main": _TRL, "accelerate.commands.launch": _ACCELERATE,
            "accelerate.commands.accelerate_cli": _ACCELERATE, "torch.distributed.run": _TORCHRUN,
            "torch.distributed.launch": _TORCHRUN, "deepspeed.launcher.runner": _DEEPSPEED,
            "llamafactory.cli": _LLAMAFACTORY, "llamafactory": _LLAMAFACTORY, "xshard": _XSHARD,
            "xshard.cli": _XSHARD}


def refuse_nested_launch(env: Mapping[str, str]) -> None:
    """A ``LaunchError`` when this launcher runs inside a process of a running job (see the module docstring)."""
    found = [f"{name}={env[name]}" for name in _JOB_VARIABLES if env.get(name)]
    if found:
        raise LaunchError(
            f"xshard launch was started inside a running job ({', '.join(found)} set: this process is one of its "
            "processes), where it would start a job of its own in each of the job's processes: run the program itself "
            "there (`python train.py ARGS`; the job already gives it its rank), or start xshard launch once, from "
            "outside the job")


def refuse_launcher_program(script: str, module: bool, env: Mapping[str, str]) -> None:
    """A ``LaunchError`` when the program given to xshard launch is a launcher (see the module docstring)."""
    fix = _MODULES.get(script) if module else _launcher_command(script, env)
    if fix is not None:
        shown = f"-m {script}" if module else script
        raise LaunchError(f"the program {shown!r} is a launcher, and each of xshard launch's processes would start a "
                          f"job of its own: {fix}")


def _launcher_command(script: str, env: Mapping[str, str]) -> str | None:
    path = Path(script)
    if not path.is_file() and os.sep not in script:
        # on PATH, or beside this Python (an environment's console scripts, not activated)
        found = shutil.which(script, path=env.get("PATH")) or shutil.which(script, path=str(Path(sys.executable).parent))
        if found is None:
            return None
        path = Path(found)
    if path.name in _COMMANDS:
        return _COMMANDS[path.name]
    try:  # a console script under another name: `from <entry module> import main`, then `sys.exit(main())`
        head = path.read_bytes()[:2048].decode("utf-8", "replace")
    except OSError:
        return None
    if not head.startswith("#!") or "sys.exit(main())" not in head:
        return None
    for line in head.splitlines():
        words = line.split()
        if words[:1] == ["from"] and words[2:4] == ["import", "main"] and words[1] in _MODULES:
            return _MODULES[words[1]]
    return None
