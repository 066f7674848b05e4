"""The transformers Trainer's train sampling strategies on 2 processes give the stock Trainer's losses.

tests/support/trainer_sft_script.py run by the stock Trainer (torchrun, Accelerate's multi-CPU data parallel)
and by xshard's (``xshard launch``), only the import changed: every step's logged loss and gradient norm agree

- with ``--train_sampling_strategy group_by_length`` (transformers' ``LengthGroupedSampler``, drawn from
  torch's RNG);
- with ``--train_sampling_strategy batch_rebalance`` and 2 loader workers (transformers'
  ``BatchRebalanceSampler`` draws each rank's share itself: prepare reads it whole, not sharded again);
- with an ``IterableDataset`` train set and ``--max_steps`` (each process reading its slice of every global
  batch: ``dispatch_batches`` off, as Accelerate's dispatching cannot join batches padded to other lengths),
  and an ``IterableDataset`` evaluation set: ``evaluate()``'s and ``predict()``'s losses and rows too.
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
SCRIPT = Path(__file__).resolve().parent / "support" / "trainer_sft_script.py"
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
XSHARD = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


def _run(command: list[str], trainer: str, model: Path, out: Path, *extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")
    args = ["--model_name_or_path", str(model), "--data_path", str(DATA), "--max_records", "48",
            "--model_max_length", "96", "--output_dir", str(out), "--learning_rate", "3e-3", "--logging_steps", "1",
            "--report_to", "none", "--disable_tqdm", "true", "--seed", "11", "--save_strategy", "no",
            "--per_device_train_batch_size", "2", "--max_steps", "6", *extra]
    # the stock job is held to its files only (support.jobs.run_writing: its gloo teardown can hang at exit)
    written = [out / "trainer_state.json", *([out / "eval_results.json"] if "--eval_records" in extra else [])]
    run_writing([*command, str(SCRIPT), *args], written, anchor=trainer == "stock", timeout=270, cwd=ROOT, env=env)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    logged: dict[str, Any] = {key: {h["step"]: h[key] for h in history if key in h and "train_runtime" not in h}
                              for key in ("loss", "grad_norm")}
    if (out / "eval_results.json").is_file():
        logged["eval"] = json.loads((out / "eval_results.json").read_text())
    return logged


@pytest.mark.parametrize("extra", [
    ("--train_sampling_strategy", "group_by_length"),
    ("--train_sampling_strategy", "batch_rebalance", "--dataloader_num_workers", "2"),
], ids=["group_by_length", "batch_rebalance_2_workers"])
def test_a_sampling_strategy_gives_the_stock_trainers_losses_on_2_processes(tiny_model, tmp_path, extra):
    stock, ours = side_by_side(lambda: _run(TORCHRUN, "stock", tiny_model, tmp_path / "stock", *extra),
                               lambda: _run(XSHARD, "xshard", tiny_model, tmp_path / "xshard", *extra))
    for key in ("loss", "grad_norm"):
        assert list(ours[key]) == list(stock[key]) == [1, 2, 3, 4, 5, 6], key
        assert list(ours[key].values()) == pytest.approx(list(stock[key].values()), rel=1e-4), key


def test_an_iterable_train_set_gives_the_stock_trainers_losses_on_2_processes(tiny_model, tmp_path):
    extra = ("--streaming", "true", "--accelerator_config", '{"dispatch_batches": false}', "--eval_records", "9")
    stock, ours = side_by_side(lambda: _run(TORCHRUN, "stock", tiny_model, tmp_path / "stock", *extra),
                               lambda: _run(XSHARD, "xshard", tiny_model, tmp_path / "xshard", *extra))
    for key in ("loss", "grad_norm"):
        assert list(ours[key]) == list(stock[key]) == [1, 2, 3, 4, 5, 6], key
        assert list(ours[key].values()) == pytest.approx(list(stock[key].values()), rel=1e-4), key
    # the held-out stream: evaluate() and predict() over an IterableDataset eval set
    assert ours["eval"]["predicted_rows"] == stock["eval"]["predicted_rows"]
    for key in ("eval_loss", "predict_loss"):
        assert ours["eval"][key] == pytest.approx(stock["eval"][key], rel=1e-4), key
