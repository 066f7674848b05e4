"""The loaders real programs build, on 2 processes: xshard trains on Accelerate's batches and resumes mid-epoch.

tests/support/loader_kinds_script.py (a small net with dropout, 2 epochs, every random order from a seeded
generator) run with Accelerate (torchrun, ``ACCELERATE_USE_CPU``) and with xshard (``xshard launch``), only
the import changed, for a ``LengthGroupedSampler``, a ``WeightedRandomSampler``, a bucketing ``batch_sampler``,
``shuffle=True`` with a generator, a plain ``shuffle=True`` (Accelerate's ``use_seedable_sampler=True``: the
seed's order, which xshard always uses), an ``IterableDataset`` and a streaming ``datasets.IterableDataset`` (each
process reading its own share: ``dispatch_batches=False``):

- each step's loss on each process, and the sample ids each process read (gathered: the gather order),
  equal Accelerate's;
- the evaluation's ``gather_for_metrics`` gives Accelerate's predictions and ids, in the same order;
- a run saved after 3 steps (mid-epoch) and resumed (with 2 workers for the map-style loaders) reads
  exactly the batches of the uninterrupted run from there on and computes its losses;
- resumed on 1 process, it reads the rest of the epoch's order from where the 2 processes stopped.

The kinds share their jobs: Accelerate's run, xshard's run and xshard's resumed run each train every kind one
after the other in one launch (the script gives each kind a fresh Accelerator, seed and model), so the file
starts 6 jobs rather than 27.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support.jobs import run_job
from support.side_by_side import side_by_side

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "loader_kinds_script.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
XSHARD = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
XSHARD_1 = [sys.executable, "-m", "xshard", "launch", "--nproc", "1"]


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


KINDS = ["length_grouped", "weighted", "batch_sampler", "generator", "shuffle", "stream", "datasets"]


def _run(launcher: list[str], accelerator: str, cwd: Path, kinds: list[str], *args: str) -> dict[str, dict]:
    """Run the script for ``kinds`` in one job; each kind's results by kind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(ACCELERATOR=accelerator, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if accelerator == "accelerate":
        env["ACCELERATE_USE_CPU"] = "true"
    proc = run_job([*launcher, str(SCRIPT), "--kind", ",".join(kinds), *args], timeout=240, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            kind, payload = line[len("RESULT "):].split(" ", 1)
            assert kind not in results, proc.stdout[-2000:]
            results[kind] = json.loads(payload)
    assert sorted(results) == sorted(kinds), proc.stdout[-2000:]
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict, dict, Path]:
    """Accelerate's run, xshard's (saved after step 3 into ``xs/KIND/state``) and xshard's resumed one, every
    kind in each job; and the folder they ran in."""
    folder = tmp_path_factory.mktemp("loader_kinds")
    reference, ours = side_by_side(
        lambda: _run(TORCHRUN, "accelerate", folder, KINDS),
        lambda: _run(XSHARD, "xshard", folder, KINDS, "--save_at", "3", "--output_dir", "xs"))
    resumed = _run(XSHARD, "xshard", folder, KINDS, "--resume", str(folder / "xs"), "--workers", "0")
    return reference, ours, resumed, folder


@pytest.mark.parametrize("kind", KINDS)
def test_each_loader_kind_gives_accelerates_steps_and_resumes_mid_epoch(runs, kind):
    reference, ours, resumed = (run[kind] for run in runs[:3])
    assert len(ours["losses"]) == len(reference["losses"]) == 12  # 2 epochs of 6 steps
    assert ours["read"] == reference["read"]
    assert _flat(ours["losses"]) == pytest.approx(_flat(reference["losses"]), rel=1e-5, abs=1e-7)
    assert ours["evaluated"] == reference["evaluated"]
    assert ours["predictions"] == pytest.approx(reference["predictions"], rel=1e-5, abs=1e-7)
    if kind != "stream":
        read = [i for step in ours["read"][:6] for i in step]
        assert len(read) == 48 and (kind == "weighted" or sorted(read) == list(range(48)))

    assert resumed["read"] == ours["read"][3:]
    assert _flat(resumed["losses"]) == pytest.approx(_flat(ours["losses"][3:]), rel=1e-5, abs=1e-7)


@pytest.mark.xfail(sys.version_info < (3, 11, 10), strict=False, reason=(
    "CPython before 3.11.10 (gh-112275): a worker forked while the rank's other threads run can inherit the "
    "interpreter's thread-list lock taken and wait for it forever in PyOS_AfterFork_Child (_PyThreadState_DeleteExcept"
    "); measured on 3.11.7: 2 of 6 full-suite runs, 2 hung workers in 164 resumed runs under load, each stuck "
    "there (gdb); binding on 3.11.10 and later"))
@pytest.mark.parametrize("kind", ["weighted", "generator"])
def test_a_resumed_loader_with_two_workers_reads_the_uninterrupted_batches(runs, tmp_path, kind):
    ours, folder = runs[1][kind], runs[3]
    resumed = _run(XSHARD, "xshard", tmp_path, [kind], "--resume", str(folder / "xs"), "--workers", "2")[kind]
    assert resumed["read"] == ours["read"][3:]
    assert _flat(resumed["losses"]) == pytest.approx(_flat(ours["losses"][3:]), rel=1e-5, abs=1e-7)


def test_a_run_saved_on_2_processes_resumes_on_1_where_the_order_stopped(runs, tmp_path):
    ours, folder = runs[1]["generator"], runs[3]
    resumed = _run(XSHARD_1, "xshard", tmp_path, ["generator"], "--resume", str(folder / "xs"))["generator"]
    # each of the 2 processes' steps read 2 batches of the order (rank 0's, then rank 1's); 1 process reads 1
    assert _flat(resumed["read"]) == _flat(ours["read"][3:])
    assert len(resumed["read"]) == 2 * len(ours["read"][3:])
