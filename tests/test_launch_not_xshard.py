"""`xshard launch` never runs something else silently: a job whose processes never built an xshard
Accelerator (a stock Accelerate script) ends with one line naming the fix and the settings that had no
effect; the same script on xshard ends without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

# An ordinary Accelerate script: one data-parallel step of a linear model on 2 CPU processes.
SCRIPT = r'''
import torch
from {module} import Accelerator

accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
loss = model(torch.ones(2, 4)).sum()
accelerator.backward(loss)
optimizer.step()
accelerator.print("processes:", accelerator.num_processes)
'''

HINT = "xshard launch: no process of this job built an xshard Accelerator"


def _run(tmp_path, module: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / f"train_{module}.py"
    script.write_text(SCRIPT.format(module=module))
    config = tmp_path / "stage2.yaml"
    config.write_text("stage: 2\n")
    return subprocess.run([sys.executable, "-m", "xshard", "launch", "--nproc", "2", "--config", str(config),
                           str(script)], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def env(clean_env):
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    clean_env.setenv("XSHARD_MIXED_PRECISION", "bf16")
    return dict(os.environ)


def test_a_stock_accelerate_script_is_named_with_the_fix_and_the_unused_settings(tmp_path, env):
    done = _run(tmp_path, "accelerate", env)
    assert done.returncode == 0, done.stderr
    assert "processes: 2" in done.stdout  # it did run, as stock Accelerate
    lines = [line for line in done.stderr.splitlines() if HINT in line]
    assert len(lines) == 1, done.stderr
    assert "from xshard import Accelerator" in lines[0] and "from xshard.trainer import Trainer" in lines[0]
    assert f"--config {(tmp_path / 'stage2.yaml').resolve()}" in lines[0]
    assert "XSHARD_MIXED_PRECISION=bf16" in lines[0] and "XSHARD_BACKEND" not in lines[0]


def test_the_same_script_on_xshard_says_nothing(tmp_path, env):
    done = _run(tmp_path, "xshard", env)
    assert done.returncode == 0, done.stderr
    assert "processes: 2" in done.stdout
    assert HINT not in done.stderr
