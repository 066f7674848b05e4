"""An ordinary Trainer SFT script (tests/support/trainer_sft_script.py) runs on xshard with only the import changed.

- One process: transformers' own Trainer and xshard's give the same losses, gradient norms, learning rates
  and evaluation results (xshard at its default stage 3, the Trainer's own seeded data order, accumulation 2).
- Two processes under ``xshard launch``: the run trains, ``checkpoint-N`` folders rotate as
  ``save_total_limit`` says, ``evaluate``/``predict`` see each held-out sample once, ``save_model`` writes a
  folder ``from_pretrained`` loads with the trained weights, and resuming from a checkpoint gives the
  uninterrupted run's losses, on 2 processes and on 1 (same global batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import run_job
from support.side_by_side import side_by_side

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "trainer_sft_script.py"
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"


def _args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(model), "--data_path", str(DATA), "--max_records", "57",
            "--eval_records", "9", "--model_max_length", "96", "--output_dir", str(out),
            "--learning_rate", "3e-3", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
            "--seed", "11", *extra]


def _run(command: list[str], args: list[str], trainer: str = "xshard", **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_vars)
    proc = run_job([*command, str(SCRIPT), *args], timeout=270, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _history(out: Path, key: str = "loss") -> dict[int, float]:
    """{global step: value} of the training log entries holding ``key``."""
    state = json.loads((out / "trainer_state.json").read_text())
    return {h["step"]: h[key] for h in state["log_history"] if key in h and "train_runtime" not in h}


def test_stock_and_xshard_trainers_give_the_same_run_in_one_process(tiny_model, tmp_path):
    extra = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "6",
             "--save_strategy", "no", "--max_grad_norm", "0.5"]
    side_by_side(lambda: _run([sys.executable], _args(tiny_model, tmp_path / "stock", *extra), trainer="stock"),
                 lambda: _run([sys.executable], _args(tiny_model, tmp_path / "xshard", *extra)))
    for key in ("loss", "grad_norm", "learning_rate"):
        stock, ours = _history(tmp_path / "stock", key), _history(tmp_path / "xshard", key)
        assert list(ours) == list(stock) == [1, 2, 3, 4, 5, 6], key
        assert list(ours.values()) == pytest.approx(list(stock.values()), rel=1e-5), key
    stock = json.loads((tmp_path / "stock" / "eval_results.json").read_text())
    ours = json.loads((tmp_path / "xshard" / "eval_results.json").read_text())
    assert ours["predicted_rows"] == stock["predicted_rows"] == 9
    assert ours["eval_loss"] == pytest.approx(stock["eval_loss"], rel=1e-5)
    assert ours["predict_loss"] == pytest.approx(stock["predict_loss"], rel=1e-5)


LAUNCH_2 = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
# 48 training records, 2 processes x 2 per device = one global batch of 4 per optimizer step: 12 steps an epoch
TWO_PROCESSES = ["--per_device_train_batch_size", "2", "--max_steps", "6", "--save_strategy", "steps",
                 "--save_steps", "2", "--save_total_limit", "2"]


@pytest.fixture(scope="module")
def full_run(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer") / "full"
    _run(LAUNCH_2, _args(tiny_model, out, *TWO_PROCESSES))
    return out


def test_two_processes_train_rotate_checkpoints_and_evaluate_each_sample_once(full_run):
    losses = _history(full_run)
    assert list(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1]
    # save_total_limit=2: checkpoint-2 was deleted; each kept one is complete
    assert sorted(p.name for p in full_run.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-4", "checkpoint-6"]
    for name in ("checkpoint-4", "checkpoint-6"):
        files = {p.name for p in (full_run / name).iterdir()}
        assert {"xshard_state.json", "trainer_state.json", "model.safetensors", "tokenizer.json",
                "rng_state_0.pth", "rng_state_1.pth"} <= files, files
        assert json.loads((full_run / name / "trainer_state.json").read_text())["global_step"] == int(name[11:])
    results = json.loads((full_run / "eval_results.json").read_text())
    assert results["predicted_rows"] == 9  # 9 held-out samples on 2 processes: the padding repeat is dropped


def test_save_model_writes_what_from_pretrained_loads(full_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(full_run)
    AutoTokenizer.from_pretrained(full_run)
    # the final checkpoint holds the same trained weights (gathered from both ranks' shards)
    final = load_file(full_run / "checkpoint-6" / "model.safetensors")
    state = model.state_dict()
    assert set(final) == set(state)
    for key, value in final.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


def test_resume_from_a_checkpoint_gives_the_uninterrupted_losses(full_run, tiny_model, tmp_path):
    uninterrupted = _history(full_run)
    out = tmp_path / "resumed"
    _run(LAUNCH_2, _args(tiny_model, out, *TWO_PROCESSES, "--resume_from_checkpoint",
                         str(full_run / "checkpoint-4")))
    resumed = _history(out)  # the checkpoint's log history (steps 1-4), then this run's
    assert list(resumed) == [1, 2, 3, 4, 5, 6]
    assert list(resumed.values()) == pytest.approx(list(uninterrupted.values()), rel=1e-5)


def test_resume_on_one_process_at_another_stage_with_the_same_global_batch(full_run, tiny_model, tmp_path):
    uninterrupted = _history(full_run)
    out = tmp_path / "one"
    one_process = list(TWO_PROCESSES)
    one_process[one_process.index("--per_device_train_batch_size") + 1] = "4"
    _run([sys.executable], _args(tiny_model, out, *one_process, "--resume_from_checkpoint",
                                 str(full_run / "checkpoint-4")), XSHARD_STAGE="1")  # saved at stage 3
    resumed = _history(out)  # the checkpoint's log history (steps 1-4), then this run's
    assert list(resumed) == [1, 2, 3, 4, 5, 6]
    assert list(resumed.values()) == pytest.approx(list(uninterrupted.values()), rel=1e-5)


def test_load_best_model_at_end_keeps_the_best_checkpoint_and_ends_with_its_weights(tiny_model, tmp_path):
    out = tmp_path / "best"
    # a constant, too high learning rate: the evaluation loss is lowest at the first evaluation, then rises
    _run(LAUNCH_2, _args(tiny_model, out, "--per_device_train_batch_size", "2", "--max_steps", "6",
                         "--learning_rate", "1e-1", "--lr_scheduler_type", "constant", "--save_steps", "2",
                         "--eval_strategy", "steps", "--eval_steps", "2", "--save_total_limit", "1",
                         "--load_best_model_at_end", "true", "--metric_for_best_model", "eval_loss"))
    state = json.loads((out / "trainer_state.json").read_text())
    evals = _history(out, "eval_loss")
    assert list(evals) == [2, 4, 6] and min(evals.values()) == evals[2] < evals[6]
    assert state["best_model_checkpoint"] == str(out / "checkpoint-2") and state["best_metric"] == evals[2]
    assert (out / "checkpoint-2" / "xshard_state.json").is_file()  # the best one is kept by the rotation
    # the evaluation after train() sees the best checkpoint's weights, not the last step's
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] == pytest.approx(evals[2], rel=1e-5)
