"""examples/qwen_finetune/finetune_loop.py (the own-loop version) end to end: 2 CPU processes, the guide's ZeRO-3 ds_config, the tiny
offline Qwen2. The loss falls, checkpoints rotate, a resume continues the same run, and the final folder
loads with from_pretrained. Plus the loop's pieces (schedule, optimizer groups, checkpoint rotation)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "qwen_finetune"
sys.path.insert(0, str(EXAMPLE))
import train_loop  # noqa: E402

STEPS = 20


def launch(output_dir: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 240) -> str:
    """Run finetune_loop.py with ``xshard launch --nproc 2`` on the CPU backend; returns the output."""
    cmd = [sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(EXAMPLE / "finetune_loop.py"),
           "--deepspeed", str(EXAMPLE / "ds_config_zero3.json"), "--output_dir", str(output_dir),
           "--per_device_train_batch_size", "4", "--model_max_length", "128", "--learning_rate", "3e-3",
           "--warmup_ratio", "0.1", "--lr_scheduler_type", "cosine", "--seed", "1234", "--logging_steps", "1",
           "--save_steps", "5", "--save_total_limit", "3", *extra]
    full_env = {**os.environ, "XSHARD_BACKEND": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune") / "run"
    return out, launch(out, "--max_steps", str(STEPS))


@pytest.mark.multiprocess
def test_loss_falls_and_everything_is_logged(first_run):
    out, output = first_run
    records = train_loop.read_log(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert first > math.log(512) * 0.9  # starts near chance over the tiny vocabulary
    assert last < first - 1.0, (first, last)
    for r in records:
        assert r["tokens_per_s"] > 0 and r["host_peak_mb"] > 0 and "grad_norm" in r
    # cosine with 2 warmup steps: lr 1.5e-3 at step 1, the peak at step 2, then down to 0 at step 20
    assert records[0]["learning_rate"] == pytest.approx(1.5e-3)
    assert records[1]["learning_rate"] == pytest.approx(3e-3)
    assert records[-1]["learning_rate"] == pytest.approx(0.0, abs=1e-12)
    assert "stage 3" in output and "training 20 steps on 2 process(es)" in output


@pytest.mark.multiprocess
def test_checkpoints_rotate_and_the_final_folder_loads(first_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = first_run
    # save_steps 5, save_total_limit 3: checkpoint-5 was deleted when checkpoint-20 was written
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-10", "checkpoint-15", "checkpoint-20"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    last = load_file(out / "checkpoint-20" / "model.safetensors")
    for key, value in model.state_dict().items():
        assert torch.equal(value, last[key]), key  # the final weights are the last step's
    ids = tokenizer("### Instruction:\nWhat is 2 plus 2?", return_tensors="pt").input_ids
    assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.multiprocess
def test_resume_continues_the_same_run(first_run, tmp_path):
    out, _ = first_run
    records = train_loop.read_log(out)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(out / "checkpoint-10", resumed_dir / "checkpoint-10")
    output = launch(resumed_dir, "--max_steps", str(STEPS), "--resume_from_checkpoint", "True")
    assert "resumed from" in output and "at step 10" in output
    resumed = train_loop.read_log(resumed_dir)
    assert [r["step"] for r in resumed] == list(range(11, STEPS + 1))  # the step counter continues
    # the loss continues where it was: the same losses as the run that never stopped
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records[10:]], rel=1e-4)
    assert [r["learning_rate"] for r in resumed] == pytest.approx([r["learning_rate"] for r in records[10:]])


@pytest.mark.multiprocess
def test_a_model_folder_is_loaded_shard_by_shard_and_trained_further(first_run, tmp_path):
    """--model_name_or_path: the fine-tuned folder, read by rows on each rank, starts where the run ended."""
    out, _ = first_run
    records = train_loop.read_log(out)
    again = tmp_path / "again"
    output = launch(again, "--model_name_or_path", str(out), "--max_steps", "2", "--learning_rate", "1e-5",
                    "--save_strategy", "no")
    assert "(safetensors):" in output and "parameter elements read by this rank" in output
    continued = train_loop.read_log(again)
    # far below the untrained model's loss, close to the end of the first run
    assert continued[0]["loss"] < records[0]["loss"] - 1.0
    assert continued[0]["loss"] == pytest.approx(records[-1]["loss"], abs=0.5)


# ---------------------------------------------------------------------------------------------- the pieces
def test_cosine_schedule_with_warmup_ratio():
    f = train_loop.lr_lambda("cosine", total_steps=100, warmup=train_loop.warmup_steps(100, 0.03))
    assert [f(s) for s in range(4)] == pytest.approx([0, 1 / 3, 2 / 3, 1])
    assert f(3 + 97 // 2) == pytest.approx(0.5 * (1 + math.cos(math.pi * (97 // 2) / 97)))
    assert f(100) == pytest.approx(0.0)
    linear = train_loop.lr_lambda("linear", total_steps=10, warmup=0)
    assert [linear(s) for s in (0, 5, 10)] == pytest.approx([1, 0.5, 0])


def test_no_weight_decay_on_norms_and_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    decay, no_decay = train_loop.decay_groups(model.named_parameters(), 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] or names[id(p)].endswith("bias") for p in no_decay["params"])
    assert {names[id(p)] for p in decay["params"]} >= {"model.embed_tokens.weight", "lm_head.weight",
                                                       "model.layers.0.self_attn.q_proj.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
