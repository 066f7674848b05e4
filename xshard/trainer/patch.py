"""Run a Trainer-based program, unedited, with every transformers Trainer in it on xshard.

    python -m xshard.trainer.patch script.py [its arguments]
    python -m xshard.trainer.patch -m package.module [its arguments]
    torchrun --nproc_per_node 2 -m xshard.trainer.patch script.py [its arguments]
    srun python -m xshard.trainer.patch -m trl.scripts.sft [its arguments]

It turns the switch on (``xshard.trainer.switch.install``) in this process, then runs the program as
``python script.py`` / ``python -m module`` would (``runpy``: ``__main__``, ``sys.argv``, ``sys.path[0]``).
``xshard launch --trainer`` starts each process this way.

Design note: a program that never imports xshard (TRL's scripts, LLaMA-Factory) can only be changed by code
that runs before it in its own process. This runner is that code, named on the command line: nothing is
installed into the environment (no ``.pth`` file, ``sitecustomize`` or ``usercustomize``, which would run in
every Python process there, tools included), and an environment variable alone could not reach the program.
"""

from __future__ import annotations

import os
import runpy
import sys

from .switch import install

USAGE = ("usage: python -m xshard.trainer.patch script.py [args...] | python -m xshard.trainer.patch -m module "
         "[args...]: runs the program with every transformers Trainer on xshard")


def main(argv: list[str] | None = None) -> None:
    """Install the switch and run the program named by ``argv`` (default: this command line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(USAGE)
    install()
    if argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]  # runpy puts the module's file first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"xshard.trainer.patch: the program {script!r} does not exist (give a script's path, "
                         "or -m and a module name)")
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
