"""The flight recorder (``backends/diagnostics/flight_recorder.py``): when a job hangs, every rank's last collectives are
written, the hung one naming the collective it waits in, and the launcher says where; ``kill -USR1`` writes a
rank's on demand.

A 2-rank ``xshard launch`` job (support script ``peer_fault_train.py``, timeout 6 s): rank 1 stays in its own
code at step 4 while rank 0 waits in step 4's first collective.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support.restarts import run_job

from xshard.backends.diagnostics.flight_recorder import DIR_ENV, FlightRecorder

SCRIPT = Path(__file__).resolve().parent / "support" / "peer_fault_train.py"
LAUNCH = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


def test_the_recorder_keeps_the_last_collectives_and_writes_them(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "flight"))
    recorder = FlightRecorder(keep=3)
    for number in range(1, 6):
        entry = recorder.issue(number, "all_gather", f"all-gather of unit layers.{number}", "world", 4096)
        entry.wait_started = entry.ended = entry.issued
    waiting = recorder.issue(6, "reduce_scatter", "reduce-scatter of unit layers.5", "ranks 0-7", 8192)
    path = recorder.write(rank=3, reason="a test")
    data = json.loads(path.read_text())
    assert path == tmp_path / "flight" / "rank3.json"
    assert [r["number"] for r in data["records"]] == [4, 5, 6]
    assert data["in_flight"] == [waiting.as_dict()] and data["in_flight"][0]["ended"] is None
    assert data["in_flight"][0]["group"] == "ranks 0-7" and data["in_flight"][0]["nbytes"] == 8192
    assert (data["rank"], data["reason"]) == (3, "a test")


@pytest.mark.multiprocess
def test_a_hang_leaves_every_ranks_record_naming_the_collective_it_waits_in(tmp_path, clean_env):
    done = run_job(SCRIPT, tmp_path / "out", LAUNCH, kill_at=None, script_args=["stall"])
    assert done.returncode != 0
    found = re.search(r"xshard launch: the last collectives of 2 rank\(s\) of this node are in (\S+)", done.stderr)
    assert found, done.stderr[-3000:]
    folder = Path(found.group(1))
    rank0 = json.loads((folder / "rank0.json").read_text())
    rank1 = json.loads((folder / "rank1.json").read_text())

    waited = rank0["in_flight"]
    assert len(waited) == 1 and waited[0]["ended"] is None and waited[0]["wait_started"] is not None
    number = waited[0]["number"]
    assert f"collective #{number}" in rank0["reason"] and "rank 1" in rank0["reason"]
    assert waited[0]["tag"] and waited[0]["tag"] in (tmp_path / "out" / "rank0.txt").read_text()
    # rank 1 stayed in its own code: it never issued that collective, and its last one ended
    assert rank1["reason"].startswith("rank 0 asked: ")
    assert rank1["in_flight"] == [] and rank1["records"][-1]["number"] == number - 1
    assert [r["number"] for r in rank0["records"][:-1]] == [r["number"] for r in rank1["records"]]


@pytest.mark.multiprocess
def test_sigusr1_writes_a_ranks_records_and_the_job_goes_on(tmp_path, clean_env):
    flight = tmp_path / "flight"
    done = run_job(SCRIPT, tmp_path / "out", LAUNCH, kill_at=None, script_args=["usr1"],
                   extra_env={DIR_ENV: str(flight)})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        data = json.loads((flight / f"rank{rank}.json").read_text())
        assert data["reason"] == "asked with SIGUSR1" and data["in_flight"] == []
        assert data["records"] and all(r["ended"] is not None for r in data["records"])
    assert f"the last collectives of 2 rank(s) of this node are in {flight}" in done.stderr
