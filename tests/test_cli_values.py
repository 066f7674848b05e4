"""Bad values on the command line and in config files: one line naming the fix, nothing run, never a
traceback; duplicated keys and impossible model sizes are refused (in-process `xshard` calls)."""

from __future__ import annotations

import json

import pytest

from xshard.cli import main

_QWEN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000}


def _one_line(capsys, argv: list[str], command: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    err = err.strip()
    assert code != 0, out
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"xshard {command}: error: "), err
    return err


@pytest.mark.parametrize("option,fix", [
    (["--max_restarts", "-1"], "--max_restarts -1: give 0 (no restart, the default) or more"),
    (["--master_port", "70000"], "--master_port 70000: a TCP port is 1..65535"),
    (["--master_port", "-3"], "a TCP port is 1..65535"),
    (["--nnodes", "0"], "--nnodes 0: give at least 1 node"),
    (["--join_timeout", "-5"], "--join_timeout -5: give the seconds"),
])
def test_launch_refuses_impossible_counts_and_ports(tmp_path, capsys, clean_env, option, fix):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert fix in _one_line(capsys, ["launch", *option, str(script)], "launch")


@pytest.mark.parametrize("name,text", [
    ("dup.yaml", "stage: 3\nmixed_precision: bf16\nstage: 0\n"),
    ("accelerate.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                        "  fsdp_sharding_strategy: NO_SHARD\nnum_processes: 2\n"),
    ("ds_config.json", '{"zero_optimization": {"stage": 3, "stage": 0}}'),
])
def test_a_config_with_a_duplicated_key_is_refused(tmp_path, capsys, clean_env, name, text):
    config, script = tmp_path / name, tmp_path / "train.py"
    config.write_text(text)
    script.write_text("raise SystemExit('must not run')\n")
    err = _one_line(capsys, ["launch", "--config", str(config), str(script)], "launch")
    assert "is given twice" in err and "keep the one you mean" in err


@pytest.mark.parametrize("change,fix", [
    ({"hidden_size": -64}, "'hidden_size' is -64, an impossible size"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' is 0, an impossible size"),
    ({"vocab_size": -1000}, "'vocab_size' is -1000"),
    ({"head_dim": -2}, "'head_dim' is -2"),
])
def test_estimate_refuses_impossible_sizes(tmp_path, capsys, change, fix):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_QWEN, **change}))
    err = _one_line(capsys, ["estimate", "--model", str(config), "--stage", "3", "--device-memory", "64GB"],
                    "estimate")
    assert fix in err and "fix the config.json" in err


def test_estimate_refuses_a_device_without_memory(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_QWEN))
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", str(config), "--stage", "3", "--device-memory", "0"])
    assert exit_.value.code == 2
    assert "device memory '0' is no memory at all" in capsys.readouterr().err
