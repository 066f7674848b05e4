"""`xshard launch --max_restarts`: a rank lost mid-run, the job restarts and resumes on its own.

The script (tests/support/restart_train.py) never calls load_state: the restarted ranks find the newest
complete checkpoint of the job themselves (``xshard.checkpoint.auto_resume``) once everything is
prepared, and the job's final weights equal those of a run that was never interrupted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xshard.checkpoint.auto_resume import record, restart_checkpoint

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parent / "support" / "restart_train.py"


def _run(out: Path, command: list[str], extra_env: dict[str, str] | None = None,
         kill_at: int | None = 7) -> subprocess.CompletedProcess:
    """``command`` on the script; rank 1 of the first attempt kills itself after step ``kill_at``."""
    out.mkdir()
    env = {**os.environ, "XSHARD_BACKEND": "cpu", **(extra_env or {})}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return subprocess.run([*command, str(SCRIPT), str(out)] + ([str(kill_at)] if kill_at else []),
                          env=env, capture_output=True, text=True, timeout=270)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("restarts") / "straight"
    done = _run(out, [sys.executable, "-m", "xshard", "launch", "--nproc", "2"], kill_at=None)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "final.pt")


def _assert_resumed_to(out: Path, done: subprocess.CompletedProcess, expected: dict) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restart 1: resumed automatically from" in done.stderr and "checkpoint-6 (step 6)" in done.stderr
    got = torch.load(out / "final.pt")
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_rank_killed_mid_run_under_torchruns_restarts_resumes_with_an_uninterrupted_runs_weights(
        uninterrupted, tmp_path, clean_env):
    """torchrun's elastic agent restarts the job; the script resumes on its own (the folder noted as
    `xshard launch` notes it)."""
    out = tmp_path / "restarted"
    done = _run(out, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      "--max-restarts", "1"], {"XSHARD_RESUME_FILE": str(tmp_path / "note")})
    _assert_resumed_to(out, done, uninterrupted)


def test_a_rank_killed_mid_run_with_xshard_launch_max_restarts_finishes_on_its_own(uninterrupted, tmp_path,
                                                                                     clean_env):
    out = tmp_path / "restarted"
    done = _run(out, [sys.executable, "-m", "xshard", "launch", "--nproc", "2", "--max_restarts", "1"])
    _assert_resumed_to(out, done, uninterrupted)


def test_only_a_restart_resumes_and_it_finds_the_folder_its_first_attempt_saved_into(tmp_path):
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-3" / "xshard_state.json").write_text('{"format_version": 3, "step": 3}')
    note = tmp_path / "note"
    env = {"XSHARD_RESUME_FILE": str(note)}
    record(tmp_path / "out" / "checkpoint-3", local_rank=0, env=env)
    assert restart_checkpoint(env=env) is None  # a first start never resumes by itself
    assert restart_checkpoint(env={**env, "TORCHELASTIC_RESTART_COUNT": "1"}) == tmp_path / "out" / "checkpoint-3"
    # without xshard launch's note, a project_dir's automatic checkpoints
    assert restart_checkpoint(tmp_path / "proj", env={"TORCHELASTIC_RESTART_COUNT": "1"}) is None
