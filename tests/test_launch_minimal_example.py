"""examples/minimal.py runs unchanged under `xshard launch` and under torchrun, with a config file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "minimal.py"
ARGS = ["--epochs", "3", "--samples", "512"]


def _run(command):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", proc.stdout)]
    return proc.stdout, losses


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("stage: 1\ngradient_accumulation_steps: 2\nseed: 3\n")
    return path


def test_xshard_launch_and_torchrun_run_the_example_with_a_config(config, clean_env):
    launched, launched_losses = _run([sys.executable, "-m", "xshard", "launch", "--nproc", "2",
                                      "--config", str(config), str(EXAMPLE), *ARGS])
    assert "world_size=2 stage=1" in launched and "accumulation=2" in launched
    assert len(launched_losses) == 3 and launched_losses[-1] < 0.5 * launched_losses[0]

    torchrun, torchrun_losses = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node", "2", str(EXAMPLE), "--config", str(config), *ARGS])
    assert "world_size=2 stage=1" in torchrun
    assert torchrun_losses == launched_losses  # same config, same seed: the same run
