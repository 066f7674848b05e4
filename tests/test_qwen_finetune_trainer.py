"""examples/qwen_finetune/finetune.py, the guide's Trainer script with the one import changed: the guide's
command line parses (transformers 4 names included), and on 2 CPU processes under ``xshard launch`` with
the guide's ZeRO-3 ds_config the loss falls, checkpoints rotate and ``save_model``'s folder loads."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import run_job

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "qwen_finetune"
sys.path.insert(0, str(EXAMPLE))

STEPS = 20

# The guide's command (as in run_npu8.sh), the script's own arguments
GUIDE = ("--model_name_or_path PyTorch-NPU/qwen1.5_7b_chat --data_path alpaca_data.json --deepspeed ds_config.json "
         "--bf16 True --output_dir ./test/output --max_steps 2000 --per_device_train_batch_size 1 "
         "--evaluation_strategy no --save_strategy steps --save_steps 3000 --save_total_limit 1 "
         "--learning_rate 1e-6 --weight_decay 0. --warmup_ratio 0.03 --lr_scheduler_type cosine --seed 1234 "
         "--logging_steps 1")


def test_the_guides_command_line_parses_with_the_trainers_meaning(tmp_path, clean_env):
    import finetune

    from xshard.trainer import sharding_config

    clean_env.setenv("XSHARD_BACKEND", "cpu")
    shutil.copy(EXAMPLE / "ds_config_zero3.json", tmp_path / "ds_config.json")
    clean_env.chdir(tmp_path)
    model_args, data_args, args = finetune.parse_arguments(shlex.split(GUIDE))
    assert (model_args.model_name_or_path, data_args.data_path) == ("PyTorch-NPU/qwen1.5_7b_chat", "alpaca_data.json")
    assert args.get_warmup_steps(args.max_steps) == 60  # --warmup_ratio 0.03 of 2000 steps
    assert args.eval_strategy.value == "no" and args.lr_scheduler_type.value == "cosine"
    assert (args.model_max_length, args.optim.value, args.bf16) == (512, "adamw_torch", True)
    config = sharding_config(args)
    assert (config.stage, config.mixed_precision, config.train_micro_batch_size_per_gpu) == (3, "bf16", 1)
    assert config.optimizer["params"] == {"lr": 1e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer") / "run"
    cmd = [sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(EXAMPLE / "finetune.py"),
           "--deepspeed", str(EXAMPLE / "ds_config_zero3.json"), "--output_dir", str(out),
           "--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--model_max_length", "128",
           "--learning_rate", "3e-3", "--warmup_ratio", "0.1", "--lr_scheduler_type", "cosine", "--seed", "1234",
           "--logging_steps", "1", "--save_steps", "5", "--save_total_limit", "2", "--disable_tqdm", "True"]
    env = {**os.environ, "XSHARD_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    done = run_job(cmd, env=env, timeout=270, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out, done.stdout + done.stderr


@pytest.mark.multiprocess
def test_the_loss_falls_and_the_schedule_is_the_guides(run):
    out, output = run
    assert "no process of this job built an xshard Accelerator" not in output
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    losses = [h["loss"] for h in steps]
    assert sum(losses[:3]) / 3 > math.log(512) * 0.9  # near chance over the tiny vocabulary
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    # cosine with warmup_ratio 0.1 of 20 steps: 2 warmup steps; the Trainer logs the rate each step used
    assert [h["learning_rate"] for h in steps[:3]] == pytest.approx([0.0, 1.5e-3, 3e-3])
    assert steps[-1]["learning_rate"] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 17 / 18)))


@pytest.mark.multiprocess
def test_checkpoints_rotate_and_save_model_loads(run):
    from tiny import build_tiny_qwen
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = run
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-15", "checkpoint-20"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    initial, _ = build_tiny_qwen()
    trained = model.state_dict()
    assert trained.keys() == initial.state_dict().keys()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"],
                           initial.state_dict()["model.layers.0.mlp.up_proj.weight"])
    ids = tokenizer("### Instruction:\nWhat is 2 plus 2?", return_tensors="pt").input_ids
    assert torch.isfinite(model(input_ids=ids).logits).all()
