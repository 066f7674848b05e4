"""`xshard config`: a documented YAML that loads back to the same config; --from converts a file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from xshard.cli import main
from xshard.config import XShardConfig

CONFIGS = Path(__file__).parent / "data" / "configs"


def test_flags_round_trip_through_the_written_yaml(tmp_path, capsys):
    argv = ["config", "--stage", "SHARD_GRAD_OP", "--mixed-precision", "bf16", "--offload-optimizer",
            "--no-forward-prefetch", "--transformer-layer-cls-to-wrap", "Qwen2DecoderLayer",
            "--gradient-clipping", "1.0", "--seed", "1234", "--devices", "8", "--reduce-dtype", "fp32"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    config = XShardConfig.load(yaml.safe_load(text), env={})
    assert config == XShardConfig(stage=2, mixed_precision="bf16", offload_optimizer=True, forward_prefetch=False,
                                  transformer_layer_cls_to_wrap=["Qwen2DecoderLayer"], gradient_clipping=1.0,
                                  seed=1234, devices=8, reduce_dtype="fp32")
    # every key is documented by a comment line right above it
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith(("#", " ", "-")):
            assert lines[i - 1].startswith("#"), f"key without a comment: {line}"


def test_default_output_loads_back_to_the_defaults(tmp_path):
    out = tmp_path / "xshard.yaml"
    assert main(["config", "-o", str(out)]) == 0
    assert XShardConfig.load(out, env={}) == XShardConfig()


def test_from_deepspeed_with_script_args(tmp_path, capsys):
    out = tmp_path / "converted.yaml"
    argv = ["config", "--from", str(CONFIGS / "ds_config_zero3.json"), "-o", str(out), "--stage", "2",
            "--script-arg", "per_device_train_batch_size=1", "--script-arg", "gradient_accumulation_steps=1",
            "--script-arg", "max_grad_norm=1.0", "--script-arg", "learning_rate=1e-6",
            "--script-arg", "adam_beta1=0.9", "--script-arg", "adam_beta2=0.999", "--script-arg", "adam_epsilon=1e-8",
            "--script-arg", "weight_decay=0.0", "--script-arg", "bf16=true"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "zero_optimization.sub_group_size" in err
    config = XShardConfig.load(out, env={})
    assert config.stage == 2  # the flag overrides the file
    assert config.mixed_precision == "bf16"
    assert config.optimizer == {"type": "AdamW",
                                "params": {"lr": 1e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}


def test_errors_print_one_line_and_exit_2(capsys):
    assert main(["config", "--stage", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xshard config: error: stage: '7' is not valid; expected 0, 1, 2, 3")
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["config", "--from", str(CONFIGS / "ds_config_zero2.json")]) == 2
    assert "optimizer.params.lr <- learning_rate" in capsys.readouterr().err


def test_as_a_subprocess(tmp_path):
    result = subprocess.run([sys.executable, "-m", "xshard", "config", "--stage", "1", "--activation-checkpointing"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = XShardConfig.load(yaml.safe_load(result.stdout), env={})
    assert (config.stage, config.activation_checkpointing) == (1, True)
