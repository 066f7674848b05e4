"""An async save under ``Accelerator(timeout=...)``: a rank frozen in the background write costs the job one
restart, not a hang.

Rank 1 stops (SIGSTOP) inside the background write of step 6's checkpoint. Rank 0 fails in its next
collective within the 20 s timeout, naming rank 1 as stopped (wherever rank 1's main thread had got to);
its own background thread, which waits for rank 1's files to commit the checkpoint, gives up after the
same 20 s (the job's timeout, asked of the Accelerator, not the config's 30 minutes), so rank 0's process
ends; the launcher restarts the job, which resumes from step 3's checkpoint and ends at the uninterrupted
run's weights.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from support.restarts import run_job

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parent / "support" / "restart_async_frozen_train.py"
LAUNCH = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


def test_a_rank_frozen_in_an_async_write_is_timed_out_and_the_job_restarts_to_the_same_weights(tmp_path, clean_env):
    straight = run_job(SCRIPT, tmp_path / "straight", LAUNCH, kill_at=None)
    assert straight.returncode == 0, straight.stderr[-3000:]
    started = time.monotonic()
    done = run_job(SCRIPT, tmp_path / "frozen", [*LAUNCH, "--max_restarts", "1"], kill_at=6)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    # rank 1 is named stopped wherever its main thread was when the background write stopped the process
    assert "These ranks are stopped, and the collective cannot complete until they go on: rank 1 (its process " \
        in done.stderr and "is stopped (SIGSTOP" in done.stderr, done.stderr[-4000:]
    assert "restart 1: resumed automatically from" in done.stderr and "checkpoint-3 (step 3)" in done.stderr
    expected, got = torch.load(tmp_path / "straight" / "final.pt"), torch.load(tmp_path / "frozen" / "final.pt")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert seconds < 150  # the timeout (20 s), torchrun's 30 s for the stopped rank, two starts
