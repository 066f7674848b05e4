"""`xshard launch` on XLA: the launcher's process never starts torch_xla's runtime.

The plan is checked here without torch_xla (devices counted from the environment and the PCI bus);
the jobs marked ``xla`` run the user's path, `xshard launch` in a subprocess, on XLA:CPU with 1 and 2
devices (they need real torch_xla: the XLA environment, PJRT_DEVICE=CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import xshard.backends.devices.xla as xla
from xshard.backends import Selection
from xshard.backends.devices.xla import XLABackend, host_device_count
from xshard.cli.launch import LaunchError, LaunchOptions, plan_launch

ROOT = Path(__file__).resolve().parent.parent


def _tpu_chips(root: Path, n: int) -> Path:
    for i in range(n):
        entry = root / f"0000:00:{i + 4:02x}.0"
        entry.mkdir(parents=True)
        (entry / "vendor").write_text("0x1ae0\n")
        (entry / "device").write_text("0x005e\n")  # TPU v4
    return root


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


@pytest.fixture
def xla_selected(clean_env):
    """XLABackend chosen as XSHARD_BACKEND=xla would choose it (without needing torch_xla here)."""
    import xshard.cli.launch as launch

    clean_env.setattr(launch, "select", lambda backend, env: Selection(XLABackend, "test"))
    return clean_env


def test_devices_are_counted_from_the_environment_and_the_pci_bus(tmp_path) -> None:
    assert host_device_count({"PJRT_DEVICE": "CPU"}) == 1
    assert host_device_count({"PJRT_DEVICE": "cpu", "CPU_NUM_DEVICES": "2"}) == 2
    assert host_device_count({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "two"}) is None
    chips = _tpu_chips(tmp_path / "pci", 4)
    assert host_device_count({"PJRT_DEVICE": "TPU"}, chips) == 4
    assert host_device_count({}, chips) == 4  # torch_xla picks TPU when one is present
    assert host_device_count({"PJRT_DEVICE": "TPU"}, tmp_path / "none") is None
    assert host_device_count({"PJRT_DEVICE": "CUDA"}, chips) is None  # torch_xla counts those itself


def test_a_tpu_vm_gets_one_process_per_chip(xla_selected, script, tmp_path) -> None:
    """The README's TPU command: `XSHARD_BACKEND=xla PJRT_DEVICE=TPU xshard launch train.py` on 4 chips."""
    xla_selected.setattr(xla, "_PCI_DEVICES", _tpu_chips(tmp_path / "pci", 4))
    xla_selected.setenv("PJRT_DEVICE", "TPU")
    plan = plan_launch(LaunchOptions(script=script, script_args=["--lr", "1"]))
    assert plan.launcher.name == "xla" and plan.nproc == 4
    assert plan.argv == [script] and plan.script_args == ["--lr", "1"]
    assert plan_launch(LaunchOptions(script=script, nproc=1)).nproc == 1
    with pytest.raises(LaunchError, match=r"either 1 process or one per local device \(4\)"):
        plan_launch(LaunchOptions(script=script, nproc=2))
    with pytest.raises(LaunchError, match="every host of the TPU slice"):
        plan_launch(LaunchOptions(script=script, nnodes=2, master_port=1))


def test_nproc_on_xla_cpu_makes_that_many_virtual_devices(xla_selected, script) -> None:
    xla_selected.setenv("PJRT_DEVICE", "CPU")
    plan = plan_launch(LaunchOptions(script=script))
    assert plan.nproc == 1 and "CPU_NUM_DEVICES" not in plan.env
    plan = plan_launch(LaunchOptions(script=script, nproc=2))
    assert plan.nproc == 2 and plan.env["CPU_NUM_DEVICES"] == "2"
    # each replica's waiting step and its queued transfers hold pool threads (see cpu_replicas_env):
    # a pool of 2 aborted the 2-device minimal example every time, 16 never
    assert int(plan.env["XLA_THREAD_POOL_SIZE"]) >= 16
    # torch_xla's asynchronous CPU client aborted about 4 runs in 10 of it; the synchronous one none
    assert plan.env["PJRT_CPU_ASYNC_CLIENT"] == "0"
    xla_selected.setenv("PJRT_CPU_ASYNC_CLIENT", "1")  # a value the user exported is theirs
    assert "PJRT_CPU_ASYNC_CLIENT" not in plan_launch(LaunchOptions(script=script, nproc=2)).env
    xla_selected.delenv("PJRT_CPU_ASYNC_CLIENT")
    xla_selected.setenv("CPU_NUM_DEVICES", "2")
    plan = plan_launch(LaunchOptions(script=script, nproc=2))
    assert plan.nproc == 2 and "CPU_NUM_DEVICES" not in plan.env  # the exported value is used as it is
    assert plan_launch(LaunchOptions(script=script)).nproc == 2
    xla_selected.setenv("CPU_NUM_DEVICES", "4")
    with pytest.raises(LaunchError, match="CPU_NUM_DEVICES=4 makes 4 XLA:CPU device.*use --nproc 1 or 4"):
        plan_launch(LaunchOptions(script=script, nproc=2))


def test_where_torch_xla_is_installed_other_backends_turn_transformers_tpu_paths_off(clean_env, script) -> None:
    """transformers takes its TPU code paths whenever torch_xla imports (a cpu job's Trainer then logged rank
    0's loss alone): the launcher sets USE_TORCH_XLA=0 for every backend but xla, unless it was exported."""
    import importlib.util

    find_spec = importlib.util.find_spec
    clean_env.setattr(importlib.util, "find_spec",
                      lambda name, *a: object() if name == "torch_xla" else find_spec(name, *a))
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    assert plan_launch(LaunchOptions(script=script, nproc=2)).env["USE_TORCH_XLA"] == "0"
    clean_env.setenv("USE_TORCH_XLA", "1")
    assert "USE_TORCH_XLA" not in plan_launch(LaunchOptions(script=script, nproc=2)).env
    clean_env.delenv("USE_TORCH_XLA")
    clean_env.setenv("PJRT_DEVICE", "CPU")
    import xshard.cli.launch as launch

    clean_env.setattr(launch, "select", lambda backend, env: Selection(XLABackend, "test"))
    assert "USE_TORCH_XLA" not in plan_launch(LaunchOptions(script=script, nproc=2)).env


def test_devices_only_torch_xla_can_count_are_left_to_it(xla_selected, script) -> None:
    xla_selected.setenv("PJRT_DEVICE", "CUDA")
    plan = plan_launch(LaunchOptions(script=script))
    assert plan.nproc is None and "xla xall local devices" in plan.describe()
    with pytest.raises(LaunchError, match="either 1 process or one per local device;"):
        plan_launch(LaunchOptions(script=script, nproc=3))


# ------------------------------------------------------------------ real jobs on XLA:CPU (marker xla)

REPLICA = r'''
import json, os, sys
import torch
from xshard.backends import get_backend

backend = get_backend()
rank, world = backend.world.rank, backend.world.world_size
t = torch.full((3,), float(rank + 1), device=backend.device())
backend.collectives.all_reduce(t, op="sum")
backend.mark_step()
record = {"rank": rank, "world": world, "sum": t.cpu().tolist(), "argv": sys.argv[1:], "pid": os.getpid(),
          "backend": os.environ.get("XSHARD_BACKEND")}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
'''


def _xla_launch(args: list[str], env: dict[str, str], timeout: float = 270) -> subprocess.CompletedProcess:
    """`xshard launch` as a user runs it (once)."""
    from support.xla_replicas import run_command

    return run_command([sys.executable, "-m", "xshard", "launch", *args], env, timeout)


def _xla_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_THREAD_POOL_SIZE", "PJRT_CPU_ASYNC_CLIENT")}
    env.update(XSHARD_BACKEND="xla", PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return env


needs_torch_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla")


@pytest.mark.xla
@needs_torch_xla
@pytest.mark.parametrize("args,extra,world", [
    ([], {}, 1),                                      # the default: one XLA:CPU device
    (["--nproc", "2"], {"CPU_NUM_DEVICES": "2"}, 2),  # the command of the bug report
], ids=["one-device", "two-devices"])
def test_xshard_launch_runs_replicas_on_xla_cpu(tmp_path, args, extra, world) -> None:
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    proc = _xla_launch([*args, str(script), str(tmp_path), "--flag"], _xla_env(**extra))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Runtime is already initialized" not in proc.stderr
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    total = float(sum(r + 1 for r in range(world)))
    for rank, record in enumerate(records):
        assert (record["rank"], record["world"], record["backend"]) == (rank, world, "xla")
        assert record["sum"] == [total] * 3 and record["argv"] == [str(tmp_path), "--flag"]


SLEEPER = r'''
import os, sys, time
import torch_xla.runtime as xr
path = os.path.join(sys.argv[1], f"pid{xr.global_ordinal()}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(300)
'''


@pytest.mark.xla
@needs_torch_xla
def test_a_killed_xla_launcher_takes_its_replica_processes_with_it(tmp_path) -> None:
    from support.launch_signals import gone_within, kill_all, wait_for_pids

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = subprocess.Popen([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(script), str(tmp_path)],
                                env=_xla_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids: list[int] = []
    try:
        pids = wait_for_pids(tmp_path, 2, launcher, timeout=240)
        assert pids[0] == pids[1] != launcher.pid  # XLA:CPU replicas are threads of one spawned process
        launcher.kill()
        launcher.wait(timeout=30)
        assert gone_within(pids, 10), f"replica process {pids[0]} outlived its killed launcher"
    finally:
        launcher.kill()
        kill_all(pids)


RAISER = r'''
import torch
import torch_xla.runtime as xr
from xshard.backends import get_backend

backend = get_backend()
if backend.world.rank == 1:
    raise ValueError("replica one cannot go on")
t = torch.ones(2, device=backend.device())
backend.collectives.all_reduce(t, op="sum")  # replica 0 waits here for replica 1, which never comes
backend.mark_step()
print(t.cpu())
'''


@pytest.mark.xla
@needs_torch_xla
def test_a_replica_that_raises_is_shown_with_its_number_and_ends_the_job(tmp_path) -> None:
    """As torchrun ends a job whose rank failed: replica 0, waiting for replica 1 in a collective, is
    not left there until XLA:CPU's 10 s abort (whose 'Termination timeout' would bury the cause)."""
    script = tmp_path / "raiser.py"
    script.write_text(RAISER)
    proc = _xla_launch(["--nproc", "2", str(script)], _xla_env(), timeout=270)
    assert proc.returncode == 1, proc.stderr[-3000:]
    shown = proc.stderr.find("xshard launch: replica 1 raised:")
    assert shown >= 0 and "ValueError: replica one cannot go on" in proc.stderr, proc.stderr[-3000:]
    stopped = proc.stderr.find("xshard launch: replica 1 failed (its message is above), so the job was stopped")
    assert stopped > shown, proc.stderr[-3000:]
    assert "Termination timeout" not in proc.stderr and "replica process died" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("ending,code", [("raise SystemExit(3)", 3), ("raise SystemExit('why')", 1),
                                          ("raise KeyError('k')", 1)])
def test_a_failing_replica_ends_its_process_with_its_exit_code_and_notes_it(tmp_path, ending, code) -> None:
    """The replica's side of ending a job of several replicas (the spawner's side: the XLA test above);
    ``sys.exit(n)`` gives the job's exit code n, as it would without xshard."""
    script = tmp_path / "fails.py"
    script.write_text(ending + "\n")
    failures = tmp_path / "failures"
    driver = ("import os, sys; from xshard.backends.launchers.xla import run_script; "
              "run_script(1, [sys.argv[1]], os.getpid(), sys.argv[2]); print('went on')")
    proc = subprocess.run([sys.executable, "-c", driver, str(script), str(failures)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == code and "went on" not in proc.stdout, proc.stderr
    assert "xshard launch: replica 1 " in proc.stderr
    from xshard.backends.launchers.xla import failed_replica

    assert failed_replica(str(failures)) == (1, code)
    assert failed_replica(str(tmp_path / "none")) is None


def test_xla_cpus_abort_is_explained_by_the_client_the_replicas_ran_on() -> None:
    """After XLA:CPU's 10 s abort the spawner says why: on torch_xla's asynchronous CPU client (its default, or
    exported) the measured cause (see cpu_replicas_env) and the fix; on the synchronous one, a replica held up."""
    from xshard.backends.launchers.xla_spawn import _abort_hint

    for exported in (None, "1", "true"):
        hint = _abort_hint(exported)
        assert "asynchronous CPU client" in hint and "set PJRT_CPU_ASYNC_CLIENT=0" in hint, hint
    for exported in ("0", "false"):
        hint = _abort_hint(exported)
        assert "PJRT_CPU_ASYNC_CLIENT" not in hint and "held up" in hint and "--nproc 1" in hint, hint
