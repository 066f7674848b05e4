"""`xshard launch`: the plan it makes, and real multi-process jobs on CPU (one node, two "nodes")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.distributed import free_port

from xshard.backends import Backend, Selection
from xshard.backends.launchers import SingleLauncher, XLALauncher
from xshard.cli.launch import LaunchError, LaunchOptions, plan_launch
from xshard.errors import XShardError

pytestmark = pytest.mark.multiprocess

# A worker that does real collective work: a few steps of data-parallel least squares on gloo, with
# each rank's data depending on its rank. It records what the launcher gave it and the result.
WORKER = r'''
import json, os, sys
import torch, torch.distributed as dist
out = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if mode.startswith("fail") and rank == 1:
    sys.exit(7)
if mode == "fail":  # the other ranks wait outside any collective: torchrun must stop them
    import time
    time.sleep(120)
g = torch.Generator().manual_seed(100 + rank)
x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
w = torch.zeros(4)
for _ in range(5):
    grad = 2 * x.T @ (x @ w - y) / len(y)
    dist.all_reduce(grad)
    w -= 0.1 * grad / world
record = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "XSHARD_BACKEND", "XSHARD_CONFIG")}
record.update(args=sys.argv[3:], w=w.tolist())
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
'''


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def _launch(*args, timeout=120, env=None):
    return subprocess.Popen([sys.executable, "-m", "xshard", "launch", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _records(folder: Path, world: int):
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def test_one_node_two_processes_and_two_nodes_on_loopback_agree(worker, tmp_path, clean_env):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    config = tmp_path / "cfg.yaml"
    config.write_text("stage: 2\n")
    code, _, err = _finish(_launch("--nproc", 2, "--config", config, worker, one, "ok", "--nproc", "5"))
    assert code == 0, err
    single = _records(one, 2)
    assert [r["RANK"] for r in single] == ["0", "1"] and {r["WORLD_SIZE"] for r in single} == {"2"}
    assert {r["XSHARD_BACKEND"] for r in single} == {"cpu"}
    assert {r["XSHARD_CONFIG"] for r in single} == {str(config.resolve())}
    assert single[0]["args"] == ["--nproc", "5"]  # options after the script belong to the script

    port = free_port()
    common = ["--nproc", 1, "--nnodes", 2, "--master_addr", "127.0.0.1", "--master_port", port]
    nodes = [_launch(*common, "--node_rank", r, worker, two) for r in (0, 1)]
    results = [_finish(p) for p in nodes]
    assert [c for c, _, _ in results] == [0, 0], [e for _, _, e in results]
    multi = _records(two, 2)
    assert [r["RANK"] for r in multi] == ["0", "1"] and [r["LOCAL_RANK"] for r in multi] == ["0", "0"]
    assert [r["w"] for r in multi] == [r["w"] for r in single]
    assert single[0]["w"] == single[1]["w"]


def test_a_failing_rank_stops_the_job_with_its_exit_code_and_name(worker, tmp_path, clean_env):
    start = time.monotonic()
    code, _, err = _finish(_launch("--nproc", 2, worker, tmp_path, "fail"), timeout=90)
    assert code == 7
    assert "xshard launch: rank 1 (local rank 1) failed with exit code 7; rank 0 was stopped" in err
    assert time.monotonic() - start < 60


def test_a_rank_dying_mid_collective_fails_its_peers_too(worker, tmp_path, clean_env):
    """Rank 1 dies while rank 0 waits in an all-reduce: no hang, both reported, non-zero exit."""
    code, _, err = _finish(_launch("--nproc", 2, worker, tmp_path, "fail_in_collective"), timeout=90)
    assert code in (1, 7)
    assert "rank 1 (local rank 1) failed with exit code 7" in err or "rank 1 exited with code 7" in err


def test_a_failing_node_takes_the_other_node_down(worker, tmp_path, clean_env):
    port = free_port()
    common = ["--nproc", 1, "--nnodes", 2, "--master_port", port]
    nodes = [_launch(*common, "--node_rank", r, worker, tmp_path, "fail_in_collective") for r in (0, 1)]
    (code0, _, err0), (code1, _, err1) = [_finish(p, timeout=90) for p in nodes]
    assert code1 == 7 and "rank 1 (local rank 0) failed with exit code 7" in err1
    assert code0 != 0 and "rank 0 (local rank 0) failed" in err0


def test_a_node_whose_peers_never_join_gives_up_after_the_join_timeout(worker, tmp_path, clean_env):
    start = time.monotonic()
    code, _, err = _finish(_launch("--nproc", 1, "--nnodes", 2, "--node_rank", 1, "--master_port", free_port(),
                                   "--join_timeout", 3, worker, tmp_path), timeout=120)
    assert code == 1 and "xshard launch: the nodes could not meet" in err and "--join_timeout" in err
    assert time.monotonic() - start < 90


# ------------------------------------------------------------------ the plan (no process started)


def test_cpu_defaults_to_one_process_and_standalone_rendezvous(worker, clean_env):
    plan = plan_launch(LaunchOptions(script=str(worker), backend="cpu"))
    assert plan.launcher.name == "torchrun" and plan.nproc == 1
    assert "--standalone" in plan.argv and plan.argv[-1] == str(worker) and plan.script_args == []
    assert plan.env["XSHARD_BACKEND"] == "cpu"


def test_the_config_file_gives_defaults_that_the_command_line_overrides(worker, tmp_path, clean_env):
    config = tmp_path / "cfg.yaml"
    config.write_text("backend: cpu\ndevices: 3\nnum_nodes: 2\n")
    plan = plan_launch(LaunchOptions(script=str(worker), config=str(config), master_port=1234))
    assert plan.nproc == 3 and "--nnodes=2" in plan.argv and plan.env["XSHARD_BACKEND"] == "cpu"
    plan = plan_launch(LaunchOptions(script=str(worker), config=str(config), nproc=1, nnodes=1))
    assert plan.nproc == 1 and "--standalone" in plan.argv
    config.write_text("stage: 7\n")
    with pytest.raises(XShardError, match="stage"):
        plan_launch(LaunchOptions(script=str(worker), config=str(config)))


def test_master_port_zero_picks_a_free_port_on_one_node_only(worker, clean_env):
    plan = plan_launch(LaunchOptions(script=str(worker), nproc=2, master_port=0))
    port = int(next(a for a in plan.argv if a.startswith("--master-port=")).split("=")[1])
    assert port > 0
    with pytest.raises(LaunchError, match="other nodes cannot know"):
        plan_launch(LaunchOptions(script=str(worker), nnodes=2, master_port=0))
    with pytest.raises(LaunchError, match="needs --master_port"):
        plan_launch(LaunchOptions(script=str(worker), nnodes=2))


@pytest.mark.parametrize("opts,message", [
    (dict(script="no_such_script.py"), "does not exist"),
    (dict(config="missing.yaml"), "--config 'missing.yaml': no such file"),
    (dict(devices="0,2"), "no visible-devices variable"),
    (dict(devices=""), "give device indices"),
    (dict(nproc=0), "at least 1"),
    (dict(nnodes=2, node_rank=2, master_port=1234), "--node_rank 2 must be in 0..1"),
])
def test_bad_options_are_refused_with_the_fix(worker, clean_env, opts, message):
    with pytest.raises(LaunchError, match=message):
        plan_launch(LaunchOptions(**{"script": str(worker), **opts}))


def test_an_unknown_backend_fails_on_the_command_line(worker, clean_env):
    proc = subprocess.run([sys.executable, "-m", "xshard", "launch", "--backend", "ipu", str(worker)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "xshard launch: error: backend='ipu' is not a known backend" in proc.stderr


class _FakeDevices(Backend):
    """A backend with 4 devices and a visible-devices variable (the launcher's view of cuda/npu)."""

    name = "fake"
    visible_devices_env = "FAKE_VISIBLE_DEVICES"

    @classmethod
    def unavailable_reason(cls):
        return None

    def device_count(self):
        return 4


class _FakeSingle(_FakeDevices):
    name = "fake1"
    max_world_size = 1

    def launcher(self):
        return SingleLauncher(self)

    def world_size_hint(self):
        return "this device runs one process"


class _FakeXLA(_FakeDevices):
    name = "fakexla"

    def launcher(self):
        return XLALauncher(self)


def _with_backend(monkeypatch, cls):
    import xshard.cli.launch as launch

    monkeypatch.setattr(launch, "select", lambda backend, env: Selection(cls, "test"))


def test_device_backends_default_to_all_devices_and_map_devices_to_their_variable(worker, clean_env):
    _with_backend(clean_env, _FakeDevices)
    assert plan_launch(LaunchOptions(script=str(worker))).nproc == 4
    plan = plan_launch(LaunchOptions(script=str(worker), devices="0,2"))
    assert plan.nproc == 2 and plan.env["FAKE_VISIBLE_DEVICES"] == "0,2"
    assert "--nproc-per-node=2" in plan.argv
    with pytest.raises(LaunchError, match="more than the 2 device"):
        plan_launch(LaunchOptions(script=str(worker), devices="0,2", nproc=3))
    with pytest.raises(XShardError, match="device 0 is listed twice"):
        plan_launch(LaunchOptions(script=str(worker), devices="0,0"))
    clean_env.setenv("FAKE_VISIBLE_DEVICES", "1,3")
    with pytest.raises(XShardError, match="FAKE_VISIBLE_DEVICES"):  # a different exported value is not overwritten
        plan_launch(LaunchOptions(script=str(worker), devices="0,2"))


def test_a_one_device_backend_refuses_more_processes(worker, clean_env):
    _with_backend(clean_env, _FakeSingle)
    plan = plan_launch(LaunchOptions(script=str(worker), nproc=1))
    assert plan.launcher.name == "single" and plan.argv == [sys.executable, "-u", str(worker)]
    assert plan_launch(LaunchOptions(script=str(worker), script_args=["--x"])).script_args == ["--x"]
    with pytest.raises(LaunchError, match="at most 1 process.*asks for 2: this device runs one process"):
        plan_launch(LaunchOptions(script=str(worker), nproc=2))


def test_xla_uses_its_own_launcher_per_host(worker, clean_env):
    _with_backend(clean_env, _FakeXLA)
    plan = plan_launch(LaunchOptions(script=str(worker), script_args=["--lr", "1"]))
    assert plan.launcher.name == "xla" and plan.nproc == 4
    assert plan.argv == [str(worker)] and plan.script_args == ["--lr", "1"]
    with pytest.raises(LaunchError, match="every host of the TPU slice"):
        plan_launch(LaunchOptions(script=str(worker), nnodes=2, master_port=1))
    with pytest.raises(LaunchError, match="either 1 process or one per local device"):
        plan_launch(LaunchOptions(script=str(worker), nproc=2))
