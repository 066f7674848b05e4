"""Config files parse strictly: a .json file is JSON only, and every syntax error names the line and column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xshard.config import XShardConfig, XShardConfigError

CONFIGS = Path(__file__).parent / "data" / "configs"


def _with_trailing_comma(tmp_path: Path, name: str) -> Path:
    # the seed ds_config with a trailing comma after its last key, on its own line
    text = json.dumps(json.loads((CONFIGS / "ds_config_zero2_basic.json").read_text()), indent=2)
    lines = text.splitlines()
    lines[-2] += ","
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trailing_comma_in_a_json_file_is_an_error_at_its_line_and_column(tmp_path):
    path = _with_trailing_comma(tmp_path, "ds_config.json")
    lines = path.read_text().splitlines()
    line = len(lines) - 1
    column = len(lines[line - 1])
    with pytest.raises(XShardConfigError) as info:
        XShardConfig.load(path, env={})
    message = str(info.value)
    assert message.startswith(f"{path}, line {line}, column {column}: a trailing comma, which JSON does not allow")
    assert "remove it" in message and "\n" not in message


def test_yaml_syntax_in_a_json_file_is_a_json_error(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1}\nzero_optimization:\n  stage: 2\n')
    with pytest.raises(XShardConfigError, match=r"ds_config.json, line 2, column 1: not valid JSON \(Extra data\)"):
        XShardConfig.load(path, env={})


def test_yaml_errors_name_the_line_and_column(tmp_path):
    path = tmp_path / "xshard.yaml"
    path.write_text("stage: 2\nmixed_precision: bf16\n  offload_params: true\n")
    with pytest.raises(XShardConfigError) as info:
        XShardConfig.load(path, env={})
    assert str(info.value).startswith(f"{path}, line 3, column 17: not valid YAML (mapping values are not allowed")


def test_yaml_files_still_read_json_and_yaml(tmp_path):
    as_json = tmp_path / "a.yaml"
    as_json.write_text('{"stage": 2, "bucket_size_mb": 2e1}')  # JSON first: YAML 1.1 reads 2e1 as a string
    assert (XShardConfig.load(as_json, env={}).stage, XShardConfig.load(as_json, env={}).bucket_size_mb) == (2, 20.0)
    as_yaml = tmp_path / "b.yml"
    as_yaml.write_text("stage: 1\n")
    assert XShardConfig.load(as_yaml, env={}).stage == 1
