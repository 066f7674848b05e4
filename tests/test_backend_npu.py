"""NPU backend, emulated: a fake torch_npu / torch.npu records what the backend asks of it, and a
test-only "hccl" process group over gloo runs real collectives in two processes.

Emulated, not tested on an NPU: these prove how xshard drives torch_npu, not that torch_npu works.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from fakes.npu import install_fake_torch_npu
from xshard.backends import (
    BackendUnavailableError,
    World,
    apply_visible_devices,
    backend_class,
    select,
)

pytest_plugins = ("fakes.fixtures",)  # fixtures: fake_npu, make_fake_npu, no_torch_npu, no_xla

NPU = backend_class("npu")
BROKEN = Path(__file__).parent / "fakes" / "broken_npu"


def test_identity_and_devices(fake_npu) -> None:
    backend = NPU(World(rank=3, world_size=8, local_rank=1, local_world_size=4))
    assert (backend.device_type, backend.dist_backend, backend.visible_devices_env) == (
        "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")
    assert backend.native_avg is False  # HCCL rejects ReduceOp.AVG
    assert backend.device() == torch.device("npu", 1)
    assert backend.device_count() == 8
    backend.set_device()
    assert fake_npu.set_device == [1]  # the local rank, not the global one
    assert NPU.vendor_version() == "2.13.0.post0+fake"


def test_set_device_beyond_visible_devices_says_what_to_do(make_fake_npu, clean_env) -> None:
    make_fake_npu(device_count=2)
    clean_env.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    backend = NPU(World(rank=2, world_size=4, local_rank=2, local_world_size=4))
    with pytest.raises(BackendUnavailableError, match=r"local rank 2 .* only 2 npu .*ASCEND_RT_VISIBLE_DEVICES='0,1'"):
        backend.set_device()


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_follows_the_chip(make_fake_npu, bf16: bool) -> None:
    make_fake_npu(bf16=bf16)
    backend = NPU(World())
    assert backend.supports(torch.bfloat16) is bf16
    assert backend.supports(torch.float16) and backend.supports(torch.float32)
    assert not backend.supports(torch.float64)
    if not bf16:
        with pytest.raises(ValueError, match="bfloat16 is not supported.*float16"):
            backend.autocast(torch.bfloat16)


def test_autocast_asks_for_the_npu_device_type(fake_npu, monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(torch, "autocast", lambda **kw: asked.append(kw) or _Null())
    with NPU(World()).autocast(torch.bfloat16):
        pass
    assert asked == [{"device_type": "npu", "dtype": torch.bfloat16}]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_grad_scaler_is_torch_npu_s_own(fake_npu) -> None:
    scaler = NPU(World()).grad_scaler()
    assert fake_npu.grad_scalers == [{"enabled": True}]
    assert scaler.kwargs == {"enabled": True}


def test_grad_scaler_falls_back_to_torch_amp_with_npu(make_fake_npu, monkeypatch) -> None:
    make_fake_npu(with_amp=False)
    built = []
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device, enabled=True: built.append((device, enabled)))
    NPU(World()).grad_scaler(enabled=False)
    assert built == [("npu", False)]


def test_visible_devices_are_sorted_for_hccl(fake_npu) -> None:
    env: dict[str, str] = {}
    assert apply_visible_devices(NPU, "6,2,4", env) == {"ASCEND_RT_VISIBLE_DEVICES": "2,4,6"}
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "2,4,6"}
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_probe_has_no_side_effects(fake_npu) -> None:
    import os

    before = dict(os.environ)
    assert NPU.unavailable_reason() is None
    assert NPU.runtime_initialized() is False
    assert fake_npu.set_device == [] and fake_npu.synchronize == 0
    assert dict(os.environ) == before


def test_no_npu_visible_names_the_variable(make_fake_npu, clean_env) -> None:
    make_fake_npu(device_count=0)
    clean_env.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    reason = NPU.unavailable_reason()
    assert "no NPU is visible" in reason and "ASCEND_RT_VISIBLE_DEVICES=''" in reason


# ---------------------------------------------------------------- torch_npu missing or broken


def test_explicit_npu_without_torch_npu(no_torch_npu) -> None:
    no_torch_npu.setenv("XSHARD_BACKEND", "npu")
    with pytest.raises(BackendUnavailableError) as err:
        select()
    message = str(err.value)
    assert "XSHARD_BACKEND=npu" in message
    assert "torch_npu is not installed" in message
    assert f"pip install torch-npu=={torch.__version__.split('+')[0]}" in message
    assert "set_env.sh" in message


@pytest.mark.parametrize("variant,cause", [("exits", "called sys.exit"), ("no_cann", "libascendcl.so")])
def test_torch_npu_that_cannot_load_is_explained(clean_env, variant: str, cause: str) -> None:
    clean_env.delitem(sys.modules, "torch_npu", raising=False)
    clean_env.syspath_prepend(str(BROKEN / variant))
    reason = NPU.unavailable_reason()  # must not exit the test process
    assert reason.startswith("torch_npu is installed but cannot load")
    assert cause in reason
    assert "set_env.sh" in reason and "CANN" in reason
    assert "torch_npu" not in sys.modules or sys.modules["torch_npu"] is None
    with pytest.raises(BackendUnavailableError, match="backend='npu' argument asks for the npu backend"):
        select("npu")


def test_runtime_check_never_imports_torch_npu(no_torch_npu) -> None:
    assert NPU.runtime_initialized() is False


# ---------------------------------------------------------------- real collectives over "hccl"


def _npu_job(rank: int, world_size: int) -> dict:
    calls = install_fake_torch_npu(device_count=world_size)
    ops = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, **kw):
        ops.append(str(op))
        return real_all_reduce(tensor, op=op, **kw)

    dist.all_reduce = recording_all_reduce
    selection = select()  # XSHARD_BACKEND=npu from the job's environment
    backend = selection.cls()
    backend.init_process_group(timeout=60)
    coll = backend.collectives
    out = {"dist_backend": dist.get_backend(), "set_device": list(calls.set_device),
           "device": str(backend.device()), "reason": selection.reason}

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
    out["ops"] = ops
    backend.destroy_process_group()
    out["initialized_after_teardown"] = dist.is_initialized()
    return out


@pytest.mark.multiprocess
def test_two_process_job_on_hccl_over_gloo() -> None:
    results = run_workers(_npu_job, 2, env={"XSHARD_BACKEND": "npu"}, timeout=120)
    mean_factor = (1 + 2) / 2
    for rank, out in enumerate(results):
        assert out["dist_backend"] == "hccl"
        assert out["set_device"] == [rank]
        assert out["device"] == f"npu:{rank}"
        assert out["reason"] == "XSHARD_BACKEND=npu"
        assert torch.equal(out["all_gather"], torch.cat([torch.arange(4.0), torch.arange(4.0) + 100]))
        expected_slice = torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) * mean_factor
        assert torch.allclose(out["reduce_scatter_avg"], expected_slice)
        assert torch.allclose(out["all_reduce_avg"], torch.full((3,), mean_factor))
        assert "ReduceOp.AVG" not in out["ops"] and out["ops"], out["ops"]  # HCCL has no AVG: SUM, then divide
        assert out["initialized_after_teardown"] is False
