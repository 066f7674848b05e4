"""Run one of Accelerate's own test scripts with xshard's Accelerator in place of Accelerate's (test-only).

    xshard launch --nproc 2 tests/support/accelerate_shim.py SCRIPT [FUNCTION ...]

SCRIPT is a path inside the installed accelerate package (``accelerate/test_utils/scripts/...``), run
from where it is installed. Before it is imported, ``accelerate.Accelerator`` (and the same name in
``accelerate.accelerator``) becomes ``xshard.Accelerator``; nothing else of Accelerate is replaced, so
the scripts' assertions judge xshard. An xshard Accelerator is built first, so that Accelerate's
``PartialState`` describes this job (``xshard.state.share_with_accelerate``) for the functions that
read it. Without FUNCTION the script runs as ``__main__``; with them, only those functions run, in order.
A FUNCTION written ``name:key=value`` is called with that keyword argument (``value`` a Python literal).
"""

from __future__ import annotations

import ast
import os
import runpy
import sys

import accelerate
import accelerate.accelerator

import xshard

accelerate.Accelerator = xshard.Accelerator
accelerate.accelerator.Accelerator = xshard.Accelerator


def main() -> None:
    script, functions = sys.argv[1], sys.argv[2:]
    sys.argv = [script]
    xshard.Accelerator()  # this job's facts for Accelerate's PartialState
    if not functions:
        runpy.run_path(script, run_name="__main__")
    else:
        namespace = runpy.run_path(script, run_name="accelerate_script")
        for call in functions:
            name, _, argument = call.partition(":")
            key, _, value = argument.partition("=")
            namespace[name](**({key: ast.literal_eval(value)} if argument else {}))
            _say(f"SHIM PASSED {call}")
    _say("SHIM DONE")


def _say(line: str) -> None:
    """One whole line on stdout in one write: the two processes share the pipe, and print() writes in pieces."""
    sys.stdout.flush()
    os.write(1, f"{line}\n".encode())


if __name__ == "__main__":
    main()
