"""A run started with the stock transformers Trainer goes on under xshard from its ``checkpoint-N``
(``xshard/checkpoint/trainer_folder.py``): the users' SFT script on 2 processes, stock on Accelerate's DDP to
step 6 with a checkpoint at step 3; then the same script with the import changed, under ``xshard launch`` at
stage 3, ``--resume_from_checkpoint true`` in a folder holding only the stock checkpoint-3: steps 4-6 log the
uninterrupted stock run's losses, and xshard's own checkpoint-6 follows.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from support.jobs import run_writing

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "support" / "trainer_sft_script.py"
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"


def _train(command: list[str], trainer: str, model: Path, out: Path, *extra: str, **env_extra: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    args = ["--model_name_or_path", str(model), "--data_path", str(DATA), "--max_records", "40", "--max_steps", "6",
            "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--logging_steps", "1",
            "--report_to", "none", "--disable_tqdm", "true", "--save_steps", "3", "--seed", "3",
            "--output_dir", str(out), *extra]
    # the stock job is held to its files only (support.jobs.run_writing: its gloo teardown can hang at exit)
    run_writing([*command, str(SCRIPT), *args], [out / "trainer_state.json"], anchor=trainer == "stock", timeout=270,
                env=env)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def test_a_stock_trainer_checkpoint_resumes_under_xshard_at_stage_3_with_the_stock_runs_losses(tiny_model, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    stock = _train(torchrun, "stock", tiny_model, tmp_path / "stock", ACCELERATE_USE_CPU="true")
    assert (tmp_path / "stock" / "checkpoint-3" / "optimizer.pt").is_file()

    resumed = tmp_path / "xshard"
    resumed.mkdir()
    shutil.copytree(tmp_path / "stock" / "checkpoint-3", resumed / "checkpoint-3")
    ours = _train([sys.executable, "-m", "xshard", "launch", "--nproc", "2"], "xshard", tiny_model, resumed,
                  "--resume_from_checkpoint", "true")
    assert len(ours) == len(stock) == 6  # the resumed run's log starts with the stock checkpoint's history
    assert ours[3:] == pytest.approx(stock[3:], rel=1e-5)
    assert (resumed / "checkpoint-6" / "xshard_state.json").is_file()
