"""`xshard launch` names xshard's code when a job fails in it before any process built an Accelerator.

A script that fails inside an xshard class (here ``ProfileKwargs(...).build()`` refusing an activity the
cpu backend cannot record) never built an Accelerator, yet the failure is xshard's: the launcher's line
names the frame of xshard's code and never says that "xshard had no part in the failure". A script that
imported xshard and then failed in its own code still gets the "no part" line.
"""

from __future__ import annotations

import os
import sys

import pytest
from support.jobs import run_job

pytestmark = pytest.mark.multiprocess

FAILS_IN_XSHARD = '''
from xshard.utils import ProfileKwargs
ProfileKwargs(activities=["gpu"]).build()
'''

FAILS_IN_SCRIPT = '''
import xshard.utils
raise ValueError("the script's own error")
'''

NO_PART = "xshard had no part in the failure"


def _launch(tmp_path, text: str):
    script = tmp_path / "train.py"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(XSHARD_BACKEND="cpu", OMP_NUM_THREADS="1")
    return run_job([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(script)], timeout=240, env=env)


def test_a_failure_inside_xshard_before_the_accelerator_is_named_as_xshards(tmp_path):
    done = _launch(tmp_path, FAILS_IN_XSHARD)
    assert done.returncode != 0
    assert "'gpu' cannot be recorded on the cpu backend" in done.stderr  # the traceback itself
    lines = [line for line in done.stderr.splitlines() if line.startswith("xshard launch: the job failed in")]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "xshard's code (xshard/accelerate_compat/profiling.py:" in lines[0]
    assert "in build_profiler)" in lines[0]
    assert NO_PART not in done.stderr


def test_a_failure_in_the_scripts_own_code_after_importing_xshard_is_not_xshards(tmp_path):
    done = _launch(tmp_path, FAILS_IN_SCRIPT)
    assert done.returncode != 0 and "the script's own error" in done.stderr
    assert NO_PART in done.stderr and "failed in xshard's code" not in done.stderr
