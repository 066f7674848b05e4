"""Counts that size memory or processes are bounded, each refusal one line naming the bound and what it is for;
`xshard env --check` checks the settings every job started here reads; a dry run's world is bounded before its
one rank builds anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xshard.cli import main as xshard_main
from xshard.config import XShardConfig, XShardConfigError


def _one_error_line(capsys: pytest.CaptureFixture[str], code: int, prefix: str) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("key,value,fragment", [
    ("max_inflight_all_gathers", "100000000000", "expected an integer in 1..64 (each unit in flight holds its full "
                                                 "parameters on the device)"),
    ("devices", "100000000000", "expected an integer in 1..1,048,576 (processes: more would be more than any job "
                                "runs)"),
    ("num_nodes", "2000000", "expected an integer in 1..1,048,576"),
    ("static_shape_multiple", "1000000000", "expected an integer in 0..1,048,576 (tokens a batch is padded to"),
])
def test_a_count_past_its_bound_is_refused_naming_the_bound(tmp_path: Path, capsys, clean_env, key: str, value: str,
                                                            fragment: str) -> None:
    config = tmp_path / "xshard.yaml"
    config.write_text(f"{key}: {value}\n")
    with pytest.raises(XShardConfigError, match=f"^{key}: {value} is not valid; "):
        XShardConfig.load(str(config), env={})
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    line = _one_error_line(capsys, xshard_main(["launch", "--nproc", "1", "--config", str(config), str(script)]),
                           "xshard launch: error: ")
    assert f"{key}: {value} is not valid; {fragment}" in line and str(config) in line, line


def test_a_count_within_its_bound_is_taken() -> None:
    assert XShardConfig.load({"max_inflight_all_gathers": 64}, env={}).max_inflight_all_gathers == 64


def test_a_dry_run_of_more_processes_than_any_job_is_refused_at_once(tmp_path: Path, capsys, clean_env) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    line = _one_error_line(capsys, xshard_main(["launch", "--dry-run", "--nnodes", "1000000", "--nproc", "8",
                                                str(script)]), "xshard launch: error: ")
    assert line == ("xshard launch: error: --nproc 8 x --nnodes 1000000 is 8,000,000 processes, more than any job "
                    "runs: give at most 1,048,576 processes in all"), line


@pytest.mark.parametrize("variable,value,said", [
    ("XSHARD_STAGE", "7", "XSHARD_STAGE: '7' is not valid; expected 0, 1, 2, 3"),
    ("XSHARD_TIMEOUT", "abc", "XSHARD_TIMEOUT: 'abc' is not valid; expected a number > 0"),
])
def test_env_check_fails_on_settings_that_stop_every_job(variable: str, value: str, said: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XSHARD_")}
    proc = subprocess.run([sys.executable, "-m", "xshard", "env", "--check"], capture_output=True, text=True,
                          timeout=240, env={**env, "XSHARD_BACKEND": "cpu", variable: value})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAIL  job_settings          {said}" in proc.stdout, proc.stdout
    assert "FAILED: job_settings" in proc.stdout and "checks passed" not in proc.stdout
    assert "PASS  matmul_fp32" in proc.stdout  # the device's own checks still run
