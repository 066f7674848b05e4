"""Malformed inputs are one line naming the fix, with no false extra line: launcher flags (a process count no
node runs, a port in use), the variables the Accelerator reads (a bad ``XSHARD_STAGE`` / ``XSHARD_TIMEOUT``:
the Accelerator's own error, not "no process built an xshard Accelerator"), a failed rendezvous, the
commands' options (``xshard env --check --timeout -1``, ``xshard estimate --nproc 10**12``, argparse's
errors without the usage block), and checkpoint manifests (a step past any counter, a nested JSON bomb,
a row-table entry of the wrong kind). In process, except where the launcher itself is the subject."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import run_job

from xshard.checkpoint.files import MANIFEST, CheckpointError
from xshard.cli import main as xshard_main
from xshard.cli.launch import MAX_NPROC_ENV, LaunchError, LaunchOptions, plan_launch

HINT = "no process of this job built an xshard Accelerator"
ESTIMATE_CONFIG = Path(__file__).parent / "data" / "estimate" / "qwen1.5-7b-chat.config.json"


def _one_error_line(capsys, rc: int, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


# ---------------------------------------------------------------------- the launcher's options


def test_a_process_count_no_node_runs_is_refused_naming_the_override(tmp_path, clean_env):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(LaunchError) as caught:
        plan_launch(LaunchOptions(script=str(script), nproc=100000, backend="cpu"))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--nproc 100000 is more processes than this node runs")
    assert f"set {MAX_NPROC_ENV}=100000" in message and "processes per CPU core" in message
    clean_env.setenv(MAX_NPROC_ENV, "100000")  # a node that really runs them
    assert plan_launch(LaunchOptions(script=str(script), nproc=100000, backend="cpu")).nproc == 100000
    clean_env.setenv(MAX_NPROC_ENV, "lots")
    with pytest.raises(LaunchError, match=f"^{MAX_NPROC_ENV}='lots': give the most processes one node may start"):
        plan_launch(LaunchOptions(script=str(script), nproc=2, backend="cpu"))


def _launch(tmp_path, *args, env=None):
    """`xshard launch` as a user runs it, its temporary folders in a folder of the test's own."""
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("XSHARD_")}
    done = run_job([sys.executable, "-m", "xshard", "launch", *map(str, args)], timeout=120,
                   env={**base, "XSHARD_BACKEND": "cpu", "TMPDIR": str(temp), **(env or {})})
    assert not list(temp.iterdir())  # nothing left behind
    return done


@pytest.mark.multiprocess  # `xshard launch` starts its ranks
@pytest.mark.parametrize("variable,value,error", [
    ("XSHARD_STAGE", "7", "XSHARD_STAGE: '7' is not valid"),
    ("XSHARD_TIMEOUT", "-5", "XSHARD_TIMEOUT: '-5' is not valid"),
])
def test_the_accelerators_own_settings_error_is_not_followed_by_a_false_not_on_xshard_line(tmp_path, variable,
                                                                                             value, error):
    script = tmp_path / "train.py"  # set by the script: the launcher refuses it when set in its own environment
    script.write_text(f"import os\nimport xshard\nos.environ[{variable!r}] = {value!r}\nxshard.Accelerator()\n")
    done = _launch(tmp_path, "--nproc", 1, script)
    assert done.returncode == 1 and error in done.stderr, done.stderr
    assert HINT not in done.stderr


@pytest.mark.multiprocess  # `xshard launch` starts its ranks
def test_a_port_in_use_names_the_port_and_how_to_choose_another(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import xshard\nxshard.Accelerator()\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _launch(tmp_path, "--nproc", 1, "--master_port", port, script)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("INFO ")]
    assert done.returncode == 2 and errors == [
        f"xshard launch: error: --master_port {port}: the port is in use on this machine (another job or program "
        "listens on it); choose another with --master_port N, or leave --master_port out on one node to pick a free "
        "one"], done.stderr


@pytest.mark.multiprocess  # `xshard launch` starts its ranks
def test_a_failed_rendezvous_is_not_followed_by_a_false_not_on_xshard_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import xshard\nxshard.Accelerator()\n")
    with socket.socket() as s:  # a port nobody listens on: node 0 never comes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _launch(tmp_path, "--nnodes", 2, "--node_rank", 1, "--master_port", port, "--join_timeout", 1, script)
    assert done.returncode == 1 and "xshard launch: the nodes could not meet" in done.stderr, done.stderr
    assert HINT not in done.stderr


# ---------------------------------------------------------------------- the commands' options


def test_env_check_refuses_a_timeout_that_is_no_time(capsys, clean_env):
    line = _one_error_line(capsys, xshard_main(["env", "--check", "--timeout", "-1"]), "xshard env: error: ")
    assert "--timeout -1: give the seconds the checks' process group waits, more than 0" in line
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("option,value,fragment", [
    ("--nproc", "1000000000000", "--nproc 1000000000000 is more devices than any job runs; give at most 1,048,576"),
    ("--seq-len", "99999999999999999", "--seq-len 99999999999999999 is longer than any model's context"),
    ("--micro-batch", str(10**23), "is more sequences than a device holds"),
])
def test_estimate_refuses_counts_no_job_has(capsys, option, value, fragment):
    rc = xshard_main(["estimate", "--model", str(ESTIMATE_CONFIG), option, value])
    assert fragment in _one_error_line(capsys, rc, "xshard estimate: error: ")


def test_an_option_argparse_refuses_is_one_line(capsys):
    with pytest.raises(SystemExit) as caught:
        xshard_main(["estimate", "--model", str(ESTIMATE_CONFIG), "--nproc", "eight"])
    line = _one_error_line(capsys, caught.value.code, "xshard estimate: error: ")
    assert "argument --nproc: invalid int value: 'eight'; see `xshard estimate --help`" in line


# ---------------------------------------------------------------------- checkpoint manifests


def _job():
    import xshard

    acc = xshard.Accelerator(config={"stage": 0}, seed=0)
    model = torch.nn.Linear(8, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return acc, model


def _edit(folder: Path, edit) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    text = edit(manifest)
    (folder / MANIFEST).write_text(text if isinstance(text, str) else json.dumps(manifest))


@pytest.mark.parametrize("edit,fragment", [
    (lambda m: json.dumps(m).replace('"step": 1', '"step": 1e30'), "key 'step' is 1e+30, expected a whole number"),
    (lambda m: json.dumps(m).replace('"step": 1', f'"step": {10**30}'),
     f"key 'step' is {10**30}, expected a whole number from 0 to {2**63 - 1}"),
    (lambda m: "[" * 200_000 + "]" * 200_000, "is not a manifest (its JSON is nested too deeply to read)"),
    (lambda m: next(iter(m["tables"].values())).update({"weight": {"shape": [8], "dtype": "float32",
                                                                   "pieces": [["model.safetensors", "0", 8]]}}),
     "tables['model0']['weight'] is"),
])
def test_a_malformed_manifest_is_one_line_and_changes_nothing(tmp_path, edit, fragment):
    acc, model = _job()
    folder = acc.save_state(tmp_path / "ckpt")
    _edit(folder, edit)
    files = sorted(p.name for p in folder.iterdir())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        acc.load_state(folder)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(folder / MANIFEST))
    assert fragment in message and message.endswith("load another checkpoint")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in folder.iterdir()) == files


def test_resuming_past_a_nested_json_bomb_falls_back_to_the_checkpoint_before(tmp_path):
    acc, _ = _job()
    acc.save_state(tmp_path / "out" / "checkpoint-1")
    acc.save_state(tmp_path / "out" / "checkpoint-2")
    (tmp_path / "out" / "checkpoint-2" / MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    assert acc.load_state(tmp_path / "out", resume_from_checkpoint=True) == tmp_path / "out" / "checkpoint-1"
