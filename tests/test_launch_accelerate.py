"""`xshard launch` reads `accelerate launch`'s common options, so a command line carries over."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xshard.backends import Backend, Selection
from xshard.cli.launch import LaunchError, launch_options, plan_launch

ROOT = Path(__file__).resolve().parent.parent
MULTI_GPU_YAML = ROOT / "tests" / "data" / "configs" / "accelerate_multi_gpu.yaml"


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def plan(*argv: str):
    return plan_launch(launch_options([str(a) for a in argv]))


def _option(plan, name: str) -> str:
    return next(a.split("=", 1)[1] for a in plan.argv if a.startswith(f"--{name}="))


def test_num_processes_is_the_count_over_all_machines(script, clean_env) -> None:
    p = plan("--num_processes", 2, script, "--num_processes", 5)
    assert p.nproc == 2 and "--nproc-per-node=2" in p.argv
    assert p.argv[-1] == script and p.script_args == ["--num_processes", "5"]  # after the script: the script's
    p = plan("--num_processes", 8, "--num_machines", 2, "--machine_rank", 1, "--main_process_ip", "10.0.0.1",
             "--main_process_port", 29501, script)
    assert p.nproc == 4
    assert [_option(p, k) for k in ("nnodes", "node-rank", "master-addr", "master-port")] == ["2", "1", "10.0.0.1",
                                                                                             "29501"]
    with pytest.raises(LaunchError, match="--num_processes 3 .* not a multiple of --num_machines 2"):
        plan("--num_processes", 3, "--num_machines", 2, "--main_process_port", 1, script)
    with pytest.raises(LaunchError, match="--nproc 2 .* and --num_processes 4 .* disagree"):
        plan("--nproc", 2, "--num_processes", 4, script)


def test_mixed_precision_is_passed_to_the_job(script, clean_env) -> None:
    assert plan("--mixed_precision", "BF16", script).env["XSHARD_MIXED_PRECISION"] == "bf16"
    assert "XSHARD_MIXED_PRECISION" not in plan(script).env
    with pytest.raises(LaunchError, match="fp8 is not supported by xshard; use no, bf16 or fp16"):
        plan("--mixed_precision", "fp8", script)
    with pytest.raises(LaunchError, match="'half': use one of no, fp16, bf16"):
        plan("--mixed_precision", "half", script)


def test_an_accelerate_config_file_gives_its_launch_settings(script, clean_env) -> None:
    p = plan("--config_file", MULTI_GPU_YAML, script)
    assert p.env["XSHARD_CONFIG"] == str(MULTI_GPU_YAML.resolve())
    assert p.nproc == 4  # num_processes 8 over num_machines 2
    assert [_option(p, k) for k in ("nnodes", "node-rank", "master-addr", "master-port")] == ["2", "0",
                                                                                             "192.168.20.1", "9898"]
    p = plan("--config_file", MULTI_GPU_YAML, "--machine_rank", 1, "--num_processes", 4, script)
    assert p.nproc == 2 and _option(p, "node-rank") == "1"  # the command line wins over the file
    bad = Path(script).with_name("bad.yaml")
    bad.write_text(MULTI_GPU_YAML.read_text().replace("machine_rank: 0", "machine_rank: first"))
    with pytest.raises(LaunchError, match="machine_rank='first' is not a whole number .it sets --machine_rank"):
        plan("--config_file", bad, script)


def test_multi_gpu_and_use_fsdp_are_accepted_and_change_nothing(script, clean_env) -> None:
    plain, flagged = plan("--num_processes", 2, script), plan("--multi_gpu", "--use_fsdp", "--num_processes", 2, script)
    assert (flagged.argv, flagged.env, flagged.nproc) == (plain.argv, plain.env, plain.nproc)


class _FourDevices(Backend):
    """The launcher's view of a backend with 4 devices and a visible-devices variable (cuda, npu)."""

    name = "fourdev"
    visible_devices_env = "FOUR_VISIBLE_DEVICES"

    @classmethod
    def unavailable_reason(cls):
        return None

    def device_count(self):
        return 4


def test_gpu_ids_choose_the_devices(script, clean_env) -> None:
    import xshard.cli.launch as launch

    clean_env.setattr(launch, "select", lambda backend, env: Selection(_FourDevices, "test"))
    p = plan("--gpu_ids", "0,2", script)
    assert p.nproc == 2 and p.env["FOUR_VISIBLE_DEVICES"] == "0,2"
    p = plan("--gpu_ids", "all", script)
    assert p.nproc == 4 and "FOUR_VISIBLE_DEVICES" not in p.env


WORKER = r'''
import json, os, sys
import xshard
acc = xshard.Accelerator()
record = {"rank": acc.rank, "world": acc.world_size, "mixed_precision": acc.config.mixed_precision,
          "args": sys.argv[2:]}
with open(os.path.join(sys.argv[1], f"rank{acc.rank}.json"), "w") as f:
    json.dump(record, f)
acc.end()
'''


@pytest.mark.multiprocess
def test_an_accelerate_command_line_runs_two_processes(tmp_path, clean_env) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-m", "xshard", "launch", "--num_processes", "2", "--mixed_precision",
                           "bf16", "--multi_gpu", str(worker), str(tmp_path), "--lr", "1"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"], r["mixed_precision"], r["args"]) for r in records] == [
        (0, 2, "bf16", ["--lr", "1"]), (1, 2, "bf16", ["--lr", "1"])]
