"""`xshard launch` never runs something else silently: a job whose processes never built an xshard
Accelerator (a stock Accelerate script) ends with one line naming the fix and the settings that had no
effect, also when it failed (then saying that xshard had no part in the failure); the same script on
xshard ends without it, and ends cleanly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.jobs import run_job

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
# torch 2.13's gloo threads release a finished work's tensors after the interpreter began to shut down
# (pytorch/pytorch#190489): a stock torchrun + Accelerate job of two CPU ranks whose script ends right
# after its step aborts at exit in about one run in five (measured: 6 of 30, also with end_training()).
ANCHOR_EXIT_ABORT = "terminate called without an active exception"


def _run(tmp_path, module: str, env: dict[str, str], script_text: str = SCRIPT) -> subprocess.CompletedProcess:
    script = tmp_path / f"train_{module}.py"
    script.write_text(script_text.format(module=module))
    config = tmp_path / "stage2.yaml"
    config.write_text("stage: 2\n")
    return run_job([sys.executable, "-m", "xshard", "launch", "--nproc", "2", "--config", str(config), str(script)],
                   timeout=270, env=env)


@pytest.fixture
def env(clean_env):
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    clean_env.setenv("XSHARD_MIXED_PRECISION", "bf16")
    return dict(os.environ)


def test_a_stock_accelerate_script_is_named_with_the_fix_and_the_unused_settings(tmp_path, env):
    done = _run(tmp_path, "accelerate", env)
    assert "processes: 2" in done.stdout  # it did run, as stock Accelerate
    if done.returncode != 0:  # the anchor's own exit abort: then the line says xshard had no part in it
        assert done.returncode == 134 and ANCHOR_EXIT_ABORT in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if HINT in line]
    assert len(lines) == 1, done.stderr
    assert ("xshard had no part in the failure" in lines[0]) == (done.returncode != 0), lines[0]
    assert "from xshard import Accelerator" in lines[0] and "from xshard.trainer import" not in lines[0]
    assert f"--config {(tmp_path / 'stage2.yaml').resolve()}" in lines[0]
    assert "XSHARD_MIXED_PRECISION=bf16" in lines[0] and "XSHARD_BACKEND" not in lines[0]


def test_a_stock_script_that_fails_is_named_as_not_xshards_failure(tmp_path, env):
    done = _run(tmp_path, "accelerate", env, SCRIPT + "raise SystemExit(3)\n")
    # the script's own exit code, or the anchor's exit abort (above) when a rank aborted first
    assert done.returncode == 3 or (done.returncode == 134 and ANCHOR_EXIT_ABORT in done.stderr), done.stderr
    lines = [line for line in done.stderr.splitlines() if HINT in line]
    assert len(lines) == 1 and "before it failed, so xshard had no part in the failure" in lines[0], done.stderr
    assert "from xshard import Accelerator" in lines[0] and "--config" in lines[0]


# Printed from an exit handler registered before the Accelerator's, so it runs after xshard's own: the
# threads of the process group that are still alive when the interpreter starts to shut down.
THREADS_AT_EXIT = r'''
import atexit, os

def _threads_at_exit():
    names = sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    line = f"process group threads at exit: {{[n for n in names if 'gloo' in n]}}\n"
    os.write(1, line.encode())  # one write: the two ranks share the pipe, and print() writes in pieces

atexit.register(_threads_at_exit)
'''


#: who starts the process group before the Accelerator joins it: xshard itself, the script, or transformers'
#: arguments (a TRL config's ``__post_init__`` starts Accelerate's ``PartialState``, which nobody leaves)
STARTERS = {
    "xshard": "",
    # imports first, as scripts do: a group started before xshard's first import is held by torch for good
    # (``backends/communication.py`` says why), and its threads outlive any leaving
    "the script": ("import torch.distributed\nfrom xshard import Accelerator\n"
                   "torch.distributed.init_process_group('gloo')\n"),
    "transformers' arguments": "import transformers\ntransformers.TrainingArguments(output_dir='unused').device\n",
}


@pytest.mark.parametrize("starter", sorted(STARTERS))
def test_the_same_script_on_xshard_says_nothing_and_leaves_no_process_group_thread_at_exit(tmp_path, env, starter):
    """The script ends right after its step without end_training(): xshard leaves the process group at
    exit, whoever started it, so no gloo thread can release a work while the interpreter shuts down (the
    anchor's abort; seen in CI from a TRL job through the mixin, whose config had started the group)."""
    done = _run(tmp_path, "xshard", env, THREADS_AT_EXIT + STARTERS[starter] + SCRIPT)
    assert done.returncode == 0, done.stderr
    assert "processes: 2" in done.stdout
    assert HINT not in done.stderr
    assert done.stdout.count("process group threads at exit: []") == 2, done.stdout
