"""``from xshard.trainer import Trainer`` where transformers' Trainer cannot be imported (accelerate, which
``xshard[hf]`` installs, missing): one ImportError naming transformers' own reason and the install, not
transformers' "Could not import module" that hides it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# accelerate absent from this process, as in an environment where it was never installed
PROGRAM = "import sys; sys.modules['accelerate'] = None\nfrom xshard.trainer import Trainer\n"


def test_a_missing_requirement_of_the_trainer_is_named_with_the_install():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: xshard.trainer needs transformers' Trainer, which cannot be imported: "), last
    assert "'accelerate'" in last and "pip install 'xshard[hf]'" in last, last
