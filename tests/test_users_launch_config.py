"""``xshard launch --config ds_config.json`` with a ds_config full of "auto" values, as users write it (the openMind
guide's ds_config_zero3.json; HF's docs write them the same way).

The launcher used to refuse every "auto" that needs a script setting: it read its script's raw command line
as if it were the script's arguments object. At launch time the launcher reads what the command line
spells out in the Trainer's arguments (``--per_device_train_batch_size 2``, ``--max-grad-norm=0.5``) and
leaves the rest to the script's process: a Trainer script fills them from its TrainingArguments (as
``--deepspeed`` does, and as the Trainer does under ``accelerate launch`` with a DeepSpeed config), an
Accelerate script as Accelerate does (accumulation from the Accelerator's argument, clipping 1.0, the
micro batch from the prepared loader). The two-process jobs assert the settings each run reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.jobs import run_job

import xshard
from xshard.cli.launch import LaunchOptions, plan_launch
from xshard.config import XShardConfig, XShardConfigError
from xshard.config.auto import LATER
from xshard.config.script_argv import launch_script_args
from xshard.trainer import TrainingArguments

ROOT = Path(__file__).resolve().parent.parent
GUIDE_DS = ROOT / "examples" / "qwen_finetune" / "ds_config_zero3.json"
SUPPORT = ROOT / "tests" / "support"
TRAINER_ARGS = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps=2", "--max-grad-norm", "0.5",
                "--learning_rate", "1e-3", "--max_steps", "2", "--report_to", "none", "--save_strategy", "no"]


@pytest.fixture(autouse=True)
def one_cpu_process(clean_env):
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    return clean_env


def _without_optimizer(tmp_path: Path) -> Path:
    """The guide's ds_config without its optimizer block: an Accelerate script brings its own optimizer."""
    data = json.loads(GUIDE_DS.read_text())
    del data["optimizer"]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    return path


# ------------------------------------------------------------------------------------------ one process

def test_the_launcher_reads_the_trainer_arguments_its_script_command_line_spells_out():
    values = launch_script_args(["--output_dir", "out", *TRAINER_ARGS, "--bf16", "--weight-decay=0.1"])
    assert values["per_device_train_batch_size"] == 2 and values["gradient_accumulation_steps"] == 2
    assert values["max_grad_norm"] == 0.5 and values["learning_rate"] == 1e-3 and values["max_steps"] == 2
    assert values["bf16"] is True and values["weight_decay"] == 0.1
    assert values["fp16"] is LATER and values["adam_beta1"] is LATER and values["world_size"] is LATER
    assert launch_script_args(["--bf16", "false", "--fp16"])["bf16"] is False
    assert launch_script_args(["--fp16"])["fp16"] is True
    # not a number: the script's own argument parser says so, with its words
    assert launch_script_args(["--per_device_train_batch_size", "two"])["per_device_train_batch_size"] is LATER
    assert launch_script_args(["--max_grad_norm", "1", "--max_grad_norm", "0.3"])["max_grad_norm"] == 0.3


def test_launch_plans_a_job_whose_ds_config_is_full_of_auto(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    for script_args in (TRAINER_ARGS, []):  # a Trainer script, an Accelerate script (no arguments)
        plan = plan_launch(LaunchOptions(script=str(script), script_args=list(script_args), nproc=2,
                                         config=str(GUIDE_DS)), env={"XSHARD_BACKEND": "cpu"})
        assert plan.nproc == 2 and plan.env["XSHARD_CONFIG"] == str(GUIDE_DS)
    # what the launcher knows at launch time: the command line's values, the rest left for the script
    config = XShardConfig.load(str(GUIDE_DS), env={}, script_args=launch_script_args(TRAINER_ARGS))
    assert (config.stage, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.gradient_clipping) == (3, 2, 2, 0.5)
    assert config.train_batch_size is None  # the world size is decided after the config is read


def test_a_trainer_fills_the_launchers_ds_config_from_its_arguments(tmp_path, one_cpu_process):
    one_cpu_process.setenv("XSHARD_CONFIG", str(GUIDE_DS))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-4)
    config = args.xshard_config
    assert (config.stage, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.gradient_clipping, config.train_batch_size) == (3, 3, 2, 0.5, 6)
    assert config.optimizer["params"]["lr"] == 1e-4
    gbs = json.loads(GUIDE_DS.read_text()) | {"gradient_accumulation_steps": 4}
    (tmp_path / "fixed.json").write_text(json.dumps(gbs))
    one_cpu_process.setenv("XSHARD_CONFIG", str(tmp_path / "fixed.json"))
    with pytest.raises(XShardConfigError, match="gradient_accumulation_steps=4 vs TrainingArguments"):
        TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", gradient_accumulation_steps=2)


def test_an_accelerate_script_with_an_optimizer_block_of_auto_gets_one_line_naming_the_key_and_the_fix():
    with pytest.raises(XShardConfigError) as caught:
        xshard.Accelerator(config=str(GUIDE_DS))
    message = str(caught.value)
    assert "\n" not in message and "optimizer.params.lr" in message
    assert "remove the ds_config's \"optimizer\"" in message


# ------------------------------------------------------------------------------------------ two processes

def _launch(config: Path, script: str, args: list[str]) -> subprocess.CompletedProcess:
    return run_job([sys.executable, "-m", "xshard", "launch", "--nproc", "2", "--config", str(config),
                    str(SUPPORT / script), *args], timeout=270)


@pytest.mark.multiprocess
def test_a_trainer_script_runs_with_the_guides_ds_config_given_to_the_launcher(tmp_path):
    out = tmp_path / "out"
    done = _launch(GUIDE_DS, "launch_config_trainer.py", ["--output_dir", str(out), *TRAINER_ARGS])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["stage"] == 3 and report["sharded_at"] == 3
    assert report["train_micro_batch_size_per_gpu"] == 2 and report["gradient_accumulation_steps"] == 2
    assert report["train_batch_size"] == 2 * 2 * 2 and report["gradient_clipping"] == 0.5
    assert report["mixed_precision"] == "no"  # bf16.enabled "auto", no --bf16
    assert report["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                               "weight_decay": 0.0}}
    assert report["global_step"] == 2 and report["seen"] == [2, 2, 2, 2]  # 2 steps of 2 micro-batches of 2


@pytest.mark.multiprocess
def test_an_accelerate_script_runs_with_a_ds_config_of_auto_given_to_the_launcher(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _launch(_without_optimizer(tmp_path), "launch_config_accelerate.py", [str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["stage"] == 3 and report["distributed_type"] == "DEEPSPEED"
    # as Accelerate fills them: the loader's batch, the Accelerator's accumulation, clipping 1.0
    assert report["train_micro_batch_size_per_gpu"] == 4 and report["gradient_accumulation_steps"] == 2
    assert report["train_batch_size"] == 4 * 2 * 2 and report["gradient_clipping"] == 1.0
    assert report["plugin"] == {"zero_stage": 3, "gradient_clipping": 1.0, "gradient_accumulation_steps": 2,
                                "train_micro_batch_size_per_gpu": 4}
    assert report["step"] == 64 // (4 * 2) // 2  # 8 micro-batches a rank, 2 per optimizer step
