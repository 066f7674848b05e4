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

import sys

from ..runtime.program import run_program
from .switch import install

USAGE = ("usage: python -m xshard.trainer.patch script.py [args...] | python -m xshard.trainer.patch -m module "
         "[args...]: runs the program with every transformers Trainer on xshard")


def main(argv: list[str] | None = None) -> None:
    """Install the switch and run the program named by ``argv`` (default: this command line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(USAGE)
    install()
    run_program(argv, "xshard.trainer.patch")


if __name__ == "__main__":
    main()
