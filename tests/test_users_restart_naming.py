"""A user's job with automatic checkpoint naming, restarted after a lost rank (``--max_restarts 1``).

The script (tests/support/restart_naming_train.py) saves with ``save_state()`` and no folder
(``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=3)``) every few steps inside its
loop over the data loader, and never calls ``load_state``. After the restart the job resumes by itself,
and its numbering must go on from the checkpoint it resumed, as the uninterrupted run named its folders
(the bug: the restarted job failed at its next save, ``checkpoint_0 already exists``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support.restarts import run_job

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parent / "support" / "restart_naming_train.py"
LAUNCH = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


def _outcome(out: Path) -> tuple[list[str], dict[str, int], dict[str, torch.Tensor]]:
    """The folders save_state returned (in order), the kept folders with the step each holds, the final weights."""
    saved = (out / "saved.txt").read_text().split()
    kept = {p.name: json.loads((p / "xshard_state.json").read_text())["step"]
            for p in sorted((out / "checkpoints").iterdir())}
    return saved, kept, torch.load(out / "final.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("naming") / "straight"
    done = run_job(SCRIPT, out, LAUNCH, kill_at=None)
    assert done.returncode == 0, done.stderr[-3000:]
    return _outcome(out)


def test_a_restarted_job_continues_its_automatic_checkpoint_numbering(uninterrupted, tmp_path, clean_env):
    saved, kept, weights = uninterrupted
    assert saved == [f"checkpoint_{n}" for n in range(5)]  # saves at steps 3, 6, 9, 12, 15
    assert kept == {"checkpoint_2": 9, "checkpoint_3": 12, "checkpoint_4": 15}  # total_limit=3

    out = tmp_path / "restarted"
    done = run_job(SCRIPT, out, [*LAUNCH, "--max_restarts", "1"], kill_at=7)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restart 1: resumed automatically from" in done.stderr and "checkpoint_1 (step 6)" in done.stderr
    got_saved, got_kept, got_weights = _outcome(out)
    assert got_saved == saved
    assert got_kept == kept
    assert sorted(got_weights) == sorted(weights)
    assert all(torch.equal(got_weights[k], weights[k]) for k in weights)
