"""finetune_loop.py's command line (examples/qwen_finetune/args.py): the openMind guide's arguments, Trainer booleans."""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen_finetune"
sys.path.insert(0, str(EXAMPLE))
import args as finetune_args  # noqa: E402

# The guide's command (seed document), with a space before every line-ending backslash.
SEED_COMMAND = """finetune.py \\
--model_name_or_path "PyTorch-NPU/qwen1.5_7b_chat" \\
--data_path alpaca_data.json \\
--deepspeed ds_config.json \\
--bf16 True \\
--output_dir ./test/output \\
--max_steps 2000 \\
--per_device_train_batch_size 1 \\
--evaluation_strategy "no" \\
--save_strategy "steps" \\
--save_steps 3000 \\
--save_total_limit 1 \\
--learning_rate 1e-6 \\
--weight_decay 0. \\
--warmup_ratio 0.03 \\
--lr_scheduler_type "cosine" \\
--seed 1234 \\
--logging_steps 1"""


@pytest.fixture
def in_run_dir(tmp_path, monkeypatch):
    """A working directory holding the ds_config.json the command names."""
    shutil.copy(EXAMPLE / "ds_config_zero3.json", tmp_path / "ds_config.json")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def shell_words(script: str) -> list[str]:
    """The words bash passes for ``script``: backslash-newline is removed, then the line is split."""
    return shlex.split(script.replace("\\\n", ""))


def parse(line: str):
    return finetune_args.parse_args(shell_words(line))


def parse_error(line: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(line)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_the_guides_command_line(in_run_dir):
    args = finetune_args.parse_args(shell_words(SEED_COMMAND)[1:])
    assert dataclasses.is_dataclass(args)
    expected = dict(model_name_or_path="PyTorch-NPU/qwen1.5_7b_chat", data_path="alpaca_data.json",
                    deepspeed="ds_config.json", bf16=True, fp16=False, output_dir="./test/output", max_steps=2000,
                    per_device_train_batch_size=1, evaluation_strategy="no", save_strategy="steps", save_steps=3000,
                    save_total_limit=1, learning_rate=1e-6, weight_decay=0.0, warmup_ratio=0.03,
                    lr_scheduler_type="cosine", seed=1234, logging_steps=1, gradient_accumulation_steps=1,
                    resume_from_checkpoint=None, config=None, fsdp="")
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.mixed_precision == "bf16"
    assert args.sharding_config_file == "ds_config.json"


def test_the_guides_typo_gets_a_clear_error(in_run_dir, capsys):
    """The guide writes `"PyTorch-NPU/qwen1.5_7b_chat"\\` with no space: the shell glues --data_path onto it."""
    glued = SEED_COMMAND.replace('"PyTorch-NPU/qwen1.5_7b_chat" \\\n', '"PyTorch-NPU/qwen1.5_7b_chat"\\\n')
    argv = shell_words(glued)[1:]
    assert "PyTorch-NPU/qwen1.5_7b_chat--data_path" in argv  # what bash passes, too
    err = parse_error(shlex.join(argv), capsys)
    assert "ran together" in err and "--data_path" in err and "space before" in err


def test_extra_arguments(in_run_dir):
    args = parse("--model_name_or_path m --data_path d.json --output_dir o --gradient_accumulation_steps 4 "
                 "--model_max_length 1024 --resume_from_checkpoint o/checkpoint-10 --config ds_config.json "
                 "--eval_strategy no --gradient_checkpointing")
    assert (args.gradient_accumulation_steps, args.model_max_length) == (4, 1024)
    assert args.resume_from_checkpoint == "o/checkpoint-10"
    assert args.config == args.sharding_config_file == "ds_config.json"
    assert args.gradient_checkpointing is True and args.mixed_precision == "no"


def test_fsdp_trainer_spelling(in_run_dir):
    (in_run_dir / "fsdp.json").write_text('{"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}')
    args = parse('--model_name_or_path m --data_path d --output_dir o --fsdp "full_shard auto_wrap offload" '
                 "--fsdp_config fsdp.json --fp16 true")
    assert args.fsdp_options == ["full_shard", "auto_wrap", "offload"]
    assert args.sharding_config_file == "fsdp.json"
    assert args.mixed_precision == "fp16"


@pytest.mark.parametrize(("word", "value"), [("True", True), ("true", True), ("1", True), ("yes", True),
                                             ("False", False), ("false", False), ("0", False), ("no", False)])
def test_trainer_booleans(word, value):
    args = parse(f"--model_name_or_path m --data_path d --output_dir o --bf16 {word}")
    assert args.bf16 is value


@pytest.mark.parametrize(("extra", "message"), [
    ("--bf16 maybe", "argument --bf16: expected True or False, got 'maybe'"),
    ("--bf16 True --fp16 True", "--bf16 and --fp16 are both True"),
    ("--lr_scheduler_type cosine_restarts", "'cosine_restarts' is not one of linear, cosine, constant"),
    ("--evaluation_strategy steps", "use \"no\""),
    ("--warmup_ratio 1.5", "must be between 0 and 1"),
    ("--learning_rate fast", "expected a number, got 'fast'"),
    ("--per_device_train_batch_size 0", "must be a positive integer"),
    ("--max_steps 0", "-1 for --num_train_epochs"),
    ("--save_strategy sometimes", "'sometimes' is not one of no, steps, epoch"),
    ("--fsdp 'full_shard wrap_all'", "unknown word(s) 'wrap_all'"),
    ("--deepspeed missing.json", "--deepspeed missing.json: no such file"),
    ("--deepspeed ds_config.json --fsdp full_shard", "--deepspeed and --fsdp both configure sharding"),
    ("--config ds_config.json --deepspeed ds_config.json", "--config and --deepspeed both configure sharding"),
    ("--fsdp_config ds_config.json", "--fsdp_config needs --fsdp"),
])
def test_bad_values_are_named(in_run_dir, capsys, extra, message):
    err = parse_error(f"--model_name_or_path m --data_path d --output_dir o {extra}", capsys)
    assert message in err


def test_required_arguments(capsys):
    err = parse_error("--model_name_or_path m --data_path d", capsys)
    assert "--output_dir" in err and "required" in err


def test_model_and_data_default_to_the_offline_tiny_setup():
    args = parse("--output_dir o")
    assert args.model_name_or_path is None and args.data_path is None


@pytest.mark.parametrize("script", ["run_npu8.sh", "run_tiny_cpu.sh"])
def test_shipped_run_scripts_pass_valid_arguments(script, tmp_path, monkeypatch):
    """Run the example's scripts under bash with stand-ins for torchrun and python that record their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("torchrun", "python"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD_DIR/{tool}.args"\n')
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD_DIR": str(tmp_path), "OUTPUT": str(tmp_path / "output"),
           "WORK": str(tmp_path / "work"), "MODEL": "PyTorch-NPU/qwen1.5_7b_chat"}
    subprocess.run(["bash", str(EXAMPLE / script)], env=env, check=True, timeout=60)
    argv = (tmp_path / "torchrun.args").read_text().splitlines()
    script_args = argv[argv.index("finetune.py") + 1:]
    monkeypatch.chdir(EXAMPLE)  # the scripts run from the example folder
    import finetune  # the Trainer script: its HfArgumentParser with xshard's TrainingArguments

    _, _, args = finetune.parse_arguments(script_args)
    assert args.deepspeed == "ds_config_zero3.json" and args.lr_scheduler_type == "cosine"
    if script == "run_npu8.sh":
        assert "--nproc_per_node=8" in argv
        assert (args.max_steps, args.learning_rate, args.bf16, args.seed) == (2000, 1e-6, True, 1234)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_guides_ds_configs_resolve_from_these_arguments(stage, in_run_dir):
    """Every "auto" in the guide's ds_config files is filled from the parsed arguments (Trainer names)."""
    from xshard.config import XShardConfig

    shutil.copy(EXAMPLE / f"ds_config_zero{stage}.json", in_run_dir / "ds_config.json")
    args = finetune_args.parse_args(shell_words(SEED_COMMAND)[1:])
    config = XShardConfig.load(args.sharding_config_file, script_args=args)
    assert (config.stage, config.mixed_precision, config.reduce_dtype) == (stage, "bf16", "fp32")
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (1, 1)
    assert config.gradient_clipping == args.max_grad_norm
    assert config.optimizer["params"] == {"lr": 1e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
