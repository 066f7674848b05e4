"""A save that one rank cannot write: the launcher's last line names that rank, with its own error, as the one
that failed, and the others as stopped because of it (never rank 0 with "another rank failed")."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.jobs import run_job

from xshard.backends.launchers.torchrun import failure_report

SCRIPT = Path(__file__).parent / "support" / "save_fails_on_rank1.py"


def _failure(exitcode: int, error: str | None = None, timestamp: int = 100, local_rank: int = 0) -> SimpleNamespace:
    data = {"message": {"message": error}} if error is not None else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=timestamp, local_rank=local_rank)


PEER = "OtherRankSaveError: cannot save the checkpoint /o/c-1 because rank 1 failed to write its part"


def test_the_rank_a_peer_names_is_the_one_that_failed_even_when_the_peer_exited_first() -> None:
    code, line = failure_report({0: _failure(1, PEER, timestamp=100),
                                 1: _failure(-int(signal.SIGTERM), "CheckpointSaveError: disk error", timestamp=101,
                                             local_rank=1)})
    assert code == 1
    assert line.startswith("xshard launch: rank 1 (local rank 1) failed with exit code 1 (CheckpointSaveError: disk "
                           "error); rank 0 was stopped because of it."), line


def test_a_named_rank_stopped_before_it_reported_still_is_the_one_that_failed() -> None:
    code, line = failure_report({0: _failure(1, PEER), 1: _failure(-int(signal.SIGTERM), local_rank=1)})
    assert code == 1
    assert line.startswith("xshard launch: rank 1 (local rank 1) failed with exit code 1 (its error is in its output "
                           "above"), line
    assert "rank 0 was stopped because of it" in line


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_xshard_launch_names_the_rank_whose_part_of_a_save_failed(tmp_path: Path, mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(XSHARD_BACKEND="cpu", OMP_NUM_THREADS="1")
    done = run_job([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(SCRIPT), str(tmp_path), mode],
                   timeout=240, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    last = [line for line in done.stderr.splitlines() if line.startswith("xshard launch: rank")]
    assert len(last) == 1, done.stderr[-3000:]
    assert last[0].startswith("xshard launch: rank 1 (local rank 1) failed with exit code 1 (CheckpointError: ") \
        or last[0].startswith("xshard launch: rank 1 (local rank 1) failed with exit code 1 (CheckpointSaveError: "), \
        last[0]
    assert "rng.rank1.pt" in last[0] or "Input/output error" in last[0], last[0]
    assert "rank 0 was stopped because of it" in last[0], last[0]
    assert not (tmp_path / "checkpoint-1").exists()
