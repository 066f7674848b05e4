"""TPU backend on TorchTPU, emulated: a fake torch_tpu / torch.tpu (tests/support/fakes/tpu.py, held to the real
torch-tpu 0.2.0 wheel by tests/test_vendor_conformance.py) answers like a TPU VM, refuses the functions
TorchTPU keeps internal exactly as the real one does, and a test-only "tpu" process group over gloo runs
real collectives in two processes.

Emulated, not tested on a TPU: these prove how xshard drives TorchTPU, not that TorchTPU works
(`xshard env --check` on a TPU VM does).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from support.distributed import run_workers
from support.fakes.tpu import install_fake_torch_tpu

from xshard.backends import BackendUnavailableError, World, backend_class, select
from xshard.backends.launchers import LaunchError, LaunchRequest

pytest_plugins = ("support.fakes.fixtures",)  # fixtures: make_fake_tpu, no_torch_tpu, fake_npu, no_xla

TPU = backend_class("tpu")


def test_identity(make_fake_tpu) -> None:
    make_fake_tpu()
    backend = TPU(World(rank=3, world_size=8, local_rank=3, local_world_size=4))
    assert (backend.device_type, backend.dist_backend, backend.visible_devices_env) == ("tpu", "tpu", None)
    assert backend.native_avg is False  # averages are SUM then divide (see backends/devices/tpu.py)
    assert backend.compiles_graphs is True  # prepared loaders pad batches to static widths, as on XLA
    assert backend.supports(torch.bfloat16) and backend.supports(torch.float32)
    assert not backend.supports(torch.float16)


def test_the_device_layer_never_calls_what_torch_tpu_keeps_internal(make_fake_tpu) -> None:
    # On torch >= 2.11 torch.tpu.device_count/set_device/synchronize/... raise when called from outside
    # torch and torch_tpu; the backend reaches the same answers through torch.accelerator
    calls = make_fake_tpu(chips=4, index=2)
    with pytest.raises(RuntimeError, match="internal to TorchTPU"):
        torch.tpu.device_count()
    calls.refused.clear()
    backend = TPU(World(rank=2, world_size=4, local_rank=2, local_world_size=4))
    assert backend.device_count() == 4
    backend.set_device()
    backend.synchronize()
    state = backend.rng_state()
    backend.set_rng_state(state)
    assert backend.memory_stats() == {"allocated": 0, "peak": 0}
    backend.reset_peak_memory_stats()
    assert backend.describe()["device_count"] == 4
    assert calls.refused == []
    assert backend._index == 2 and calls.synchronize == 1


def test_rng_state_is_the_bound_chip_s_generator(make_fake_tpu) -> None:
    make_fake_tpu(chips=4, index=1)
    backend = TPU(World())
    backend.set_device()
    state = backend.rng_state()
    torch.tpu.default_generators[1].manual_seed(123)
    assert not torch.equal(backend.rng_state(), state)
    backend.set_rng_state(state)
    assert torch.equal(backend.rng_state(), state)


def test_fp16_is_refused_naming_bf16(make_fake_tpu) -> None:
    make_fake_tpu()
    backend = TPU(World())
    with pytest.raises(ValueError, match="use bf16 instead"):
        backend.grad_scaler()
    assert backend.grad_scaler(enabled=False).is_enabled() is False
    with pytest.raises(ValueError, match="float16 is not supported.*bfloat16"):
        backend.autocast(torch.float16)


def test_auto_takes_tpu_before_xla(make_fake_tpu, clean_env) -> None:
    make_fake_tpu()
    clean_env.setattr(backend_class("xla"), "unavailable_reason", classmethod(lambda cls: None))
    selection = select()
    assert selection.name == "tpu" and selection.skipped == ()


def test_torch_tpu_loaded_without_autoload_is_loaded_by_its_entry_point(make_fake_tpu) -> None:
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0: `import torch_tpu` registers nothing until _loader.load() runs
    make_fake_tpu(autoload=False)
    assert not hasattr(torch, "tpu")
    assert TPU.unavailable_reason() is None
    assert hasattr(torch, "tpu")


def test_no_tpu_chip_is_explained(make_fake_tpu, clean_env) -> None:
    make_fake_tpu(chips=0)
    clean_env.setenv("XSHARD_BACKEND", "tpu")
    with pytest.raises(BackendUnavailableError, match="XSHARD_BACKEND=tpu .* registered no tpu device: .*PCI bus"):
        select()


def test_explicit_tpu_without_torch_tpu(no_torch_tpu) -> None:
    no_torch_tpu.setenv("XSHARD_BACKEND", "tpu")
    with pytest.raises(BackendUnavailableError, match=r"torch_tpu is not installed: pip install torch-tpu .*libtpu"):
        select()


def test_torch_tpu_that_cannot_load_is_explained(clean_env, tmp_path) -> None:
    package = tmp_path / "torch_tpu"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('libtpu.so: cannot open shared object file')\n")
    clean_env.delitem(sys.modules, "torch_tpu", raising=False)
    clean_env.syspath_prepend(str(tmp_path))
    reason = TPU.unavailable_reason()
    assert reason.startswith("torch_tpu is installed but cannot load") and "libtpu.so" in reason
    assert "pip install libtpu" in reason and "2.11 to 2.15" in reason


def test_probe_has_no_side_effects(make_fake_tpu) -> None:
    calls = make_fake_tpu()
    before = dict(os.environ)
    assert TPU.unavailable_reason() is None
    assert TPU.runtime_initialized() is False and calls.runtime_started is False
    assert dict(os.environ) == before


def test_xshard_env_without_torch_tpu_is_one_line_naming_the_install() -> None:
    from test_env_cli import assert_one_line_error, xshard_env

    proc = xshard_env(env={"XSHARD_BACKEND": "tpu"})
    assert_one_line_error(proc, "XSHARD_BACKEND=tpu", "torch_tpu is not installed", "pip install torch-tpu")


def test_xshard_env_reports_the_tpu_backend(make_fake_tpu, clean_env) -> None:
    from xshard.cli.env import gather

    make_fake_tpu(chips=4)
    clean_env.setenv("XSHARD_BACKEND", "tpu")
    selection = select()
    report = gather(selection, selection.cls(World()))
    assert (report["backend"], report["dist_backend"], report["device_count"]) == ("tpu", "tpu", 4)
    assert report["precision"] == {"fp32": True, "fp16": False, "bf16": True} and report["native_avg"] is False
    assert report["versions"]  # no crash on a vendor without __version__


# ---------------------------------------------------------------- the launcher


def _request(**kw) -> LaunchRequest:
    return LaunchRequest(backend="tpu", script="train.py", script_args=("--lr", "1"), **kw)


def test_launch_plans_one_process_per_chip_with_torch_tpu_s_launch_env(make_fake_tpu, clean_env) -> None:
    calls = make_fake_tpu(chips=4)
    clean_env.setattr("xshard.backends.devices.xla.tpu_chip_count", lambda *a: 4)
    backend = TPU(World())
    assert backend.host_device_count() == 4  # from the PCI bus: the runtime stays free for the workers
    before = dict(os.environ)
    plan = backend.launcher().plan(_request(nproc=backend.host_device_count()))
    assert f"--nproc-per-node={4}" in plan.argv and plan.argv[-1] == "train.py" and plan.script_args == ["--lr", "1"]
    assert calls.launch_env_calls == [{"nnodes": 1, "nproc_per_node": 4}]
    assert plan.env["TORCH_TPU_TOPOLOGY"] == "2,2,1"
    assert len(plan.env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 4
    assert dict(os.environ) == before  # the plan carries the variables; this process keeps its own
    assert calls.runtime_started is False


def test_xshard_launch_plans_torchrun_per_chip_for_tpu(make_fake_tpu, clean_env, tmp_path) -> None:
    from xshard.cli.launch import LaunchOptions, plan_launch

    make_fake_tpu(chips=4)
    clean_env.setattr("xshard.backends.devices.xla.tpu_chip_count", lambda *a: 4)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = plan_launch(LaunchOptions(script=str(script), backend="tpu"))
    assert plan.nproc == 4 and plan.env["XSHARD_BACKEND"] == "tpu"
    assert "TORCH_TPU_SLICEBUILDER_ADDRESSES" in plan.env and "--nproc-per-node=4" in plan.argv
    assert "TORCH_TPU_TOPOLOGY" in plan.describe()
    with pytest.raises(LaunchError, match="has no visible-devices variable"):
        plan_launch(LaunchOptions(script=str(script), backend="tpu", devices="0,1"))


def test_launch_keeps_the_user_s_launch_variables(make_fake_tpu, clean_env) -> None:
    make_fake_tpu(chips=4)
    clean_env.setenv("TORCH_TPU_TOPOLOGY", "2,2,1")
    plan = TPU(World()).launcher().plan(_request(nproc=4))
    assert "TORCH_TPU_TOPOLOGY" not in plan.env  # set by the user: inherited as it is
    assert os.environ["TORCH_TPU_TOPOLOGY"] == "2,2,1"


def test_launch_without_a_chip_count_says_what_to_give(make_fake_tpu) -> None:
    make_fake_tpu()
    with pytest.raises(LaunchError, match="give --nproc"):
        TPU(World()).launcher().plan(_request(nproc=None))


def test_launch_env_refusal_is_a_launch_error(make_fake_tpu, clean_env) -> None:
    make_fake_tpu(chips=4)
    clean_env.setattr(torch.tpu.distributed, "set_tpu_launch_env",
                      lambda **kw: (_ for _ in ()).throw(ValueError("expected nnodes to match TPU_WORKER_HOSTNAMES")))
    with pytest.raises(LaunchError, match="TorchTPU cannot set up this launch: expected nnodes"):
        TPU(World()).launcher().plan(_request(nproc=4))


LAUNCHED = r'''
import json, os, sys
import torch
import torch.distributed as dist
from xshard.backends import get_backend
backend = get_backend()
backend.init_process_group(timeout=60)
t = torch.full((2,), float(backend.world.rank + 1))
backend.collectives.all_reduce(t, op="avg")
record = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCH_TPU_TOPOLOGY",
                                         "TORCH_TPU_SLICEBUILDER_ADDRESSES")}
record.update(dist=dist.get_backend(), device=str(backend.device()), avg=t.tolist())
with open(os.path.join(sys.argv[1], f"rank{backend.world.rank}.json"), "w") as f:
    json.dump(record, f)
backend.destroy_process_group()
'''


@pytest.mark.multiprocess
def test_xshard_launch_starts_one_process_per_chip_on_the_tpu_group(tmp_path) -> None:
    import json
    import subprocess
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = tmp_path / "job.py"
    script.write_text(LAUNCHED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "TORCH_TPU_"))}
    env.update(XSHARD_BACKEND="tpu", FAKE_TPU_CHIPS="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tests / "support" / "fakes" / "tpu_vm"), str(tests.parent)]))
    proc = subprocess.run([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(script), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert (record["RANK"], record["LOCAL_RANK"], record["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert record["dist"] == "tpu" and record["device"] == f"tpu:{rank}"
        assert record["avg"] == [1.5, 1.5]
    # TorchTPU's launch variables, decided once in the launcher, are the same on every rank
    assert records[0]["TORCH_TPU_TOPOLOGY"] == records[1]["TORCH_TPU_TOPOLOGY"] == "1,2,1"
    assert records[0]["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == records[1]["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
    assert len(records[0]["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 2


# ---------------------------------------------------------------- real collectives over "tpu"


def _tpu_job(rank: int, world_size: int) -> dict:
    install_fake_torch_tpu(chips=world_size, index=rank, name_device=True)
    from xshard.backends.collectives import process_group as module  # the names DistCollectives calls

    ops = []

    def recording(real):
        def call(*args, **kw):
            ops.append(str(kw.get("op", dist.ReduceOp.SUM)))
            return real(*args, **kw)
        return call

    module.dist.all_reduce = recording(dist.all_reduce)
    module._reduce_scatter_single = recording(module._reduce_scatter_single)
    selection = select()  # XSHARD_BACKEND=tpu from the job's environment
    backend = selection.cls()
    backend.init_process_group(timeout=60)
    coll = backend.collectives
    out = {"dist_backend": dist.get_backend(), "device": str(backend.device()), "reason": selection.reason}
    shard = torch.arange(4, dtype=torch.float32) + 100 * rank
    gathered = torch.empty(4 * world_size)
    coll.all_gather_into_tensor(gathered, shard)
    out["all_gather"] = gathered
    full = torch.arange(4 * world_size, dtype=torch.float32) * (rank + 1)
    mine = torch.empty(4)
    coll.reduce_scatter_tensor(mine, full, op="avg")
    out["reduce_scatter_avg"] = mine
    t = torch.full((3,), float(rank + 1))
    coll.all_reduce(t, op="avg")
    out["all_reduce_avg"] = t
    out["ops"] = list(ops)
    with backend.autocast(torch.bfloat16):
        out["autocast"] = (torch.is_autocast_enabled("tpu"), torch.get_autocast_dtype("tpu"))
    import xshard

    acc = xshard.Accelerator(config={"stage": 0})  # joins the running "tpu" group
    out["accelerator"] = (str(acc.device), acc.num_processes, acc.state.distributed_type.value)
    backend.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_two_process_job_on_tpu_over_gloo() -> None:
    results = run_workers(_tpu_job, 2, env={"XSHARD_BACKEND": "tpu"}, timeout=120)
    mean_factor = (1 + 2) / 2
    for rank, out in enumerate(results):
        assert out["dist_backend"] == "tpu" and out["reason"] == "XSHARD_BACKEND=tpu"
        assert out["device"] == f"tpu:{rank}"  # the chip TorchTPU bound this process to
        assert torch.equal(out["all_gather"], torch.cat([torch.arange(4.0), torch.arange(4.0) + 100]))
        expected_slice = torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) * mean_factor
        assert torch.allclose(out["reduce_scatter_avg"], expected_slice)
        assert torch.allclose(out["all_reduce_avg"], torch.full((3,), mean_factor))
        assert out["ops"] == [str(dist.ReduceOp.SUM)] * 2  # averages are SUM then divide here
        assert out["autocast"] == (True, torch.bfloat16)
        assert out["accelerator"] == (f"tpu:{rank}", 2, "MULTI_TPU")
