"""A peer lost mid-collective is named for what happened to it: a killed rank dead, a rank whose script
raised crashed (with its exception, by its peer and by the launcher), never "never arrived" (which is said
only of a live rank).

Rank 1 of a 2-rank ``xshard launch`` job fails while rank 0 waits in a collective for it (support
script ``peer_fault_train.py``); rank 0's error is what its user reads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.restarts import run_job

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parent / "support" / "peer_fault_train.py"
LAUNCH = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


def _peer_fault(tmp_path: Path, fault: str) -> tuple[subprocess.CompletedProcess, str | None]:
    """The job's output, and rank 0's error (None: the launcher stopped rank 0 before it had its say)."""
    out = tmp_path / "out"
    done = run_job(SCRIPT, out, LAUNCH, kill_at=None, script_args=[fault])
    seen = out / "rank0.txt"
    return done, seen.read_text() if seen.exists() else None


def test_a_rank_killed_mid_collective_is_named_dead(tmp_path, clean_env):
    done, message = _peer_fault(tmp_path, "kill")
    assert done.returncode == 137, done.stderr[-3000:]
    assert "xshard launch: rank 1 (local rank 1) failed with exit code 137" in done.stderr
    # torchrun stops rank 0 (SIGTERM) a moment after rank 1's death: rank 0 may be stopped before it speaks,
    # but whatever it said names rank 1 dead
    assert "never arrived" not in done.stderr and "has waited" not in done.stderr, done.stderr[-3000:]
    assert message is None or message.startswith("RankDiedError: rank 1 died (process "), message


def test_a_rank_whose_script_raised_is_named_crashed_with_its_exception(tmp_path, clean_env):
    done, message = _peer_fault(tmp_path, "raise")
    assert done.returncode == 1, done.stderr[-3000:]
    assert message is not None, f"rank 0 said nothing about rank 1:\n{done.stderr[-3000:]}"
    assert message.startswith("RankDiedError: rank 1 crashed with ValueError: the labels of batch 4 hold NaN"), message
    assert "never arrived" not in message and "deadlock" not in message
    # the launcher names the rank that crashed first, with its exception (rank 0 failed because of it)
    assert ("xshard launch: rank 1 (local rank 1) failed with exit code 1 (ValueError: the labels of batch 4 hold "
            "NaN); rank 0 ") in done.stderr, done.stderr[-2000:]  # rank 0 exited, or torchrun stopped it
