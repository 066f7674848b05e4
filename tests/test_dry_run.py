"""`xshard launch --dry-run` (``xshard/cli/dry_run.py``): one process, as one rank of the target job over torch's
fake process group, predicts what each rank of the real job holds and sends, and refuses what cannot start.

The script is a user's (``support/dry_run_train.py``: checkpoints on); the real job runs it under
``xshard launch`` and writes what it measured after step 2; the dry run reports the same figures from one
process, for the same world.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parent / "support" / "dry_run_train.py"
ROOT = Path(__file__).resolve().parent.parent


def _launch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XSHARD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "xshard", "launch", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=240)


def _dry(tmp_path: Path, *args: str, script_args: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    done = _launch("--dry-run", "--dry_run_report", str(report), *args, str(SCRIPT), str(tmp_path / "dry"),
                   *script_args, cwd=tmp_path)
    return done, json.loads(report.read_text()) if report.is_file() else {}


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """The real run of each (nproc, script_args), made once: the rank cases of one configuration share it."""
    runs: dict[tuple, Path] = {}

    def real(nproc: int, script_args: tuple[str, ...]) -> Path:
        if (nproc, script_args) not in runs:
            folder = tmp_path_factory.mktemp("real")
            done = _launch("--nproc", str(nproc), str(SCRIPT), str(folder / "real"), *script_args, cwd=folder)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[nproc, script_args] = folder / "real"
        return runs[nproc, script_args]

    return real


@pytest.mark.parametrize(("nproc", "script_args", "rank"), [
    (2, ("--stage", "3"), 0),
    (2, ("--stage", "3"), 1),
    (2, ("--stage", "2"), 0),
    (4, ("--stage", "3", "--shard_group_size", "2"), 3),  # hybrid: sharded in pairs, averaged across them
])
def test_the_dry_run_predicts_each_ranks_units_state_and_collectives(tmp_path, real_runs, nproc, script_args, rank):
    real = real_runs(nproc, script_args)
    measured = json.loads((real / f"rank{rank}.json").read_text())

    done, report = _dry(tmp_path, "--nproc", str(nproc), "--dry_run_rank", str(rank), script_args=script_args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (report["world_size"], report["rank"], report["steps"]) == (nproc, rank, 2)
    model = report["models"][0]
    assert len(model["units"]) == measured["units"] == 5
    assert model["state_bytes"] == measured["state_bytes"]
    assert report["collectives_per_step"] == measured["collectives_per_step"]
    if "--shard_group_size" in script_args:
        assert "all_reduce_inter" in report["collectives_per_step"]["calls"]
    assert f"ran 2 optimizer step(s) as rank {rank} of {nproc}" in done.stderr
    assert not (tmp_path / "dry" / "state").exists()  # the dry run ended before the script's first save

    # the files the real run's save_state (step 5) had this rank write: its .rank<R>. files, and rank 0 the rest
    saved = real / "state"
    written = {f.name: f.stat().st_size for f in saved.iterdir() if f.name != "xshard_state.json"
               and (f".rank{rank}." in f.name or (rank == 0 and ".rank" not in f.name))}
    planned = report["checkpoint_files"]
    assert set(planned) == set(written)
    for name, size in planned.items():  # safetensors: the tensors' bytes, the file's small header aside
        assert 0 <= written[name] - size <= (16384 if name.endswith(".safetensors") else 64), name


def test_a_dry_run_at_1024_ranks_reports_the_padding_of_the_shards(tmp_path):
    done, report = _dry(tmp_path, "--nnodes", "128", "--nproc", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["world_size"] == 1024 and report["local_world_size"] == 8
    model = report["models"][0]
    assert model["plan"].startswith("stage 3: parameters sharded over all 1024 rank(s)")
    # a Block's 96 x 96 weight and 96 bias, each padded to ceil(rows / 1024) rows on each of 1,024 ranks
    block = 4 * 1024 * (math.ceil(96 / 1024) * 96 + math.ceil(96 / 1024) * 1)
    assert [u["bytes"] for u in model["units"] if u["name"] != "<root>"] == [block] * 4
    assert model["parameters"] == 16 * 96 + 96 + 4 * (96 * 96 + 96) + 96 * 4 + 4
    assert "model memory on the device at its peak" in done.stderr


def test_a_hybrid_group_that_does_not_divide_the_world_is_refused(tmp_path):
    done, report = _dry(tmp_path, "--nnodes", "2", "--nproc", "8", script_args=("--shard_group_size", "3"))
    assert done.returncode == 1 and report == {}
    assert "shard_group_size=3 must divide the world size 16" in done.stderr, done.stderr[-3000:]
    assert "the script failed as rank 0 of 16 (exit code 1): this job cannot start at that size" in done.stderr


def test_a_model_that_does_not_fit_the_device_is_refused_naming_the_fix(tmp_path):
    done, report = _dry(tmp_path, "--nproc", "8", "--device-memory", "100KB")
    assert done.returncode == 1
    assert report["fits"] is False and report["peak_model_bytes"] > 0.9 * report["device_memory"] == 90_000
    assert "more than a run may use of the 100.00 KB of --device-memory (90%" in done.stderr, done.stderr[-2000:]
    fits, _ = _dry(tmp_path, "--nproc", "8", "--device-memory", "80GB")
    assert fits.returncode == 0 and "fits in 80.00 GB" in fits.stderr
    bad = _launch("--dry-run", "--device-memory", "lots", str(SCRIPT), str(tmp_path / "x"), cwd=tmp_path)
    assert bad.returncode != 0 and "--device-memory: device memory 'lots' is not a size" in bad.stderr, bad.stderr
