"""``--torch_compile`` on the Trainer, and what the arguments report of the processes, beside the stock Trainer.

tests/support/trainer_compile_script.py (a tiny three-block model, 3 steps) on 2 CPU processes: the stock
Trainer under torchrun (Accelerate's multi-CPU DDP, which compiles the DDP model with
``torch.compile(model, backend="aot_eager")``) and xshard's under ``xshard launch`` at stages 0 and 3, the same
command line. aot_eager rather than the default inductor: inductor's C++ code generation takes minutes on this
machine's two cores, and aot_eager traces the same graphs (forward and backward through AOTAutograd).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from support.jobs import run_writing
from support.side_by_side import side_by_side

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "trainer_compile_script.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
XSHARD = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
ARGS = ["--max_steps", "3", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--logging_steps", "1",
        "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "5",
        "--ddp_timeout", "600", "--ddp_bucket_cap_mb", "1"]
COMPILE = ["--torch_compile", "--torch_compile_backend", "aot_eager"]


def _run(command: list[str], impl: str, out: Path, *extra: str, **env_vars: str) -> list[dict[str, Any]]:
    """Each rank's record (facts, losses, graph count). The stock job's exit is not under test
    (``support.jobs.run_writing``: stock gloo's teardown can hang or abort a rank after its record is written)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(TRAINER_IMPL=impl, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_vars)
    records = [out / f"rank{rank}.json" for rank in (0, 1)]
    run_writing([*command, str(SCRIPT), *ARGS, *extra, "--output_dir", str(out)], records, anchor=impl == "stock",
                timeout=270, cwd=ROOT, env=env)
    return [json.loads(record.read_text()) for record in records]


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("compile")
    # Accelerate runs a multi-CPU job only when told the device is the CPU (else each rank is a job of one)
    stock, stage0 = side_by_side(
        lambda: _run(TORCHRUN, "stock", tmp / "stock", *COMPILE, ACCELERATE_USE_CPU="true"),
        lambda: _run(XSHARD, "xshard", tmp / "stage0", *COMPILE, XSHARD_STAGE="0"))
    stage3 = _run(XSHARD, "xshard", tmp / "stage3", *COMPILE, XSHARD_STAGE="3")
    return {"stock": stock, "stage0": stage0, "stage3": stage3}


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_torch_compile_compiles_and_gives_the_stock_trainers_losses(compiled_runs, stage):
    stock, ours = compiled_runs["stock"], compiled_runs[stage]
    assert stock[0]["graphs"] > 0
    for rank in (0, 1):
        assert len(ours[rank]["losses"]) == len(stock[rank]["losses"]) == 3
        assert ours[rank]["losses"] == pytest.approx(stock[rank]["losses"], rel=1e-5)
        assert ours[rank]["graphs"] > 0, "the model ran eagerly: --torch_compile was ignored"


def test_the_arguments_report_the_processes_as_the_stock_arguments_do(compiled_runs):
    for rank in (0, 1):
        stock, ours = dict(compiled_runs["stock"][rank]["facts"]), dict(compiled_runs["stage3"][rank]["facts"])
        # Accelerate's multi-CPU state names the device "cpu:0" on every rank, xshard "cpu": the same device
        assert stock.pop("device").split(":")[0] == ours.pop("device") == "cpu"
        assert ours == stock
        assert ours["n_gpu"] == 0 and ours["world_size"] == 2 and ours["process_index"] == rank
