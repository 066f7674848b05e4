"""A launcher started inside a launcher is refused at once, in one line naming the fix, instead of starting
a job in each of the job's processes (or waiting on a shared rendezvous port for peers that never come):
``xshard launch`` run by a process of a running torchrun / xshard launch job (torchrun's
``TORCHELASTIC_RUN_ID`` / ``LOCAL_RANK``, xshard launch's marker folder), and a program that is itself a
launcher (TRL's and Accelerate's CLIs, torchrun, as a command, its console script or ``-m``)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from support.jobs import run_job

from xshard.backends.launchers import LaunchError
from xshard.cli.launch import LaunchOptions, plan_launch

ROOT = Path(__file__).resolve().parent.parent
XSHARD = [sys.executable, "-m", "xshard", "launch"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XSHARD_", "TORCHELASTIC_")) and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), XSHARD_BACKEND="cpu", **extra)
    return env


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("variable", ["TORCHELASTIC_RUN_ID", "LOCAL_RANK", "XSHARD_LAUNCH_MARKERS"])
def test_xshard_launch_inside_a_jobs_process_is_refused_naming_the_fix(tmp_path, variable):
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    with pytest.raises(LaunchError, match=rf"started inside a running job \({variable}=.* run the program itself "
                                          r"there \(`python train.py ARGS`"):
        plan_launch(LaunchOptions(script=str(script), nproc=2), _env(**{variable: "0"}))


@pytest.mark.parametrize(("program", "module", "fix"), [
    ("trl", False, "xshard launch --trainer --nproc N -m trl.scripts.sft ARGS"),
    ("trl.cli", True, "-m trl.scripts.sft"),
    ("accelerate", False, "give xshard launch the script it would run"),
    ("accelerate.commands.launch", True, "give xshard launch the script it would run"),
    ("torchrun", False, "torchrun is a launcher"),
    ("torch.distributed.run", True, "torchrun is a launcher"),
])
def test_a_launcher_as_the_program_is_refused_naming_the_fix(program, module, fix):
    if not module:  # as the user types it: the console script of this environment, or its path
        assert shutil.which(program, path=str(Path(sys.executable).parent)) is not None
    with pytest.raises(LaunchError) as caught:
        plan_launch(LaunchOptions(script=program, module=module, nproc=2), _env())
    shown = f"-m {program}" if module else program
    assert f"the program {shown!r} is a launcher" in str(caught.value) and fix in str(caught.value)
    if not module:
        with pytest.raises(LaunchError, match="is a launcher"):
            plan_launch(LaunchOptions(script=str(Path(sys.executable).parent / program), nproc=2), _env())


def test_trl_sft_under_xshard_launch_is_refused_in_one_line_at_once(tmp_path):
    started = time.monotonic()
    done = run_job([*XSHARD, "--nproc", "2", "trl", "sft", "--model_name_or_path", "m", "--dataset_name", "d"],
                   timeout=120, cwd=tmp_path, env=_env())
    assert done.returncode != 0 and time.monotonic() - started < 60
    line = _one_line(done.stderr)
    assert line.startswith("xshard launch: error: the program 'trl' is a launcher"), line
    assert "xshard launch --trainer --nproc N -m trl.scripts.sft ARGS" in line


@pytest.mark.multiprocess
def test_xshard_launch_run_by_a_jobs_process_is_refused_and_the_job_ends(tmp_path):
    # a training script that starts a launcher itself (as a program that spawns its own job would)
    inner = tmp_path / "inner.py"
    inner.write_text("print('inner ran')\n")
    outer = tmp_path / "outer.py"
    outer.write_text(f"import subprocess, sys\n"
                     f"done = subprocess.run({XSHARD!r} + ['--nproc', '2', {str(inner)!r}])\n"
                     f"sys.exit(done.returncode)\n")
    started = time.monotonic()
    done = run_job([*XSHARD, "--nproc", "2", str(outer)], timeout=120, cwd=tmp_path, env=_env())
    assert done.returncode != 0 and time.monotonic() - started < 90
    refusals = [line for line in done.stderr.splitlines() if "started inside a running job" in line]
    # one from each process of the outer job that reached it: the launcher stops the other rank when the first
    # fails, and that rank may be stopped before its own refusal (measured in CI: 1 line, with the stop named)
    assert len(refusals) == 2 or (len(refusals) == 1 and "was stopped" in done.stderr), done.stderr
    assert "inner ran" not in done.stdout
