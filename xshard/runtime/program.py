"""Run a program as ``python script.py`` / ``python -m module`` would, from inside a runner that prepared this
process first (``xshard.trainer.patch``: the Trainer switch; ``xshard.cli.dry_run``: the dry run's backend).

``runpy`` gives the program ``__main__``, ``sys.argv`` and ``sys.path[0]`` as Python's own command line does.
"""

from __future__ import annotations

import os
import runpy
import sys


def run_program(argv: list[str], runner: str) -> None:
    """Run ``argv`` (``[script, args...]`` or ``["-m", module, args...]``); ``runner`` names the caller in errors."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(f"{runner}: give the program: script.py [args...] or -m module [args...]")
    if argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]  # runpy puts the module's file first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"{runner}: the program {script!r} does not exist (give a script's path, or -m and a "
                         "module name)")
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    runpy.run_path(script, run_name="__main__")
