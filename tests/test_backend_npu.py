"""NPU backend, emulated: a fake torch_npu / torch.npu (tests/support/fakes/npu.py, held to the real torch_npu
2.13.0 by tests/test_vendor_conformance.py) records what the backend asks of it, and a test-only "hccl"
process group over gloo runs real collectives in two processes.

Emulated, not tested on an NPU: these prove how xshard drives torch_npu, not that torch_npu works
(`xshard env --check` on the hardware does).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from support.distributed import run_workers
from support.fakes.npu import install_fake_torch_npu

from xshard.backends import (
    BackendUnavailableError,
    World,
    apply_visible_devices,
    backend_class,
    select,
)
from xshard.sharding import ShardedGradScaler

pytest_plugins = ("support.fakes.fixtures",)  # fixtures: fake_npu, make_fake_npu, no_torch_npu, no_xla

NPU = backend_class("npu")
BROKEN = Path(__file__).parent / "support" / "fakes" / "broken_npu"


def test_identity_and_devices(fake_npu) -> None:
    backend = NPU(World(rank=3, world_size=8, local_rank=1, local_world_size=4))
    assert (backend.device_type, backend.dist_backend, backend.visible_devices_env) == (
        "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")
    assert backend.native_avg is True  # ProcessGroupHCCL takes ReduceOp.AVG (a sum, then a divide)
    assert backend.device() == torch.device("npu", 1)
    assert backend.device_count() == 8
    backend.set_device()
    assert fake_npu.set_device == [1]  # the local rank, not the global one
    assert NPU.vendor_version() == "2.13.0.post0+fake"


def test_set_device_beyond_visible_devices_says_what_to_do(make_fake_npu, clean_env) -> None:
    make_fake_npu(device_count=8)
    clean_env.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    backend = NPU(World(rank=2, world_size=4, local_rank=2, local_world_size=4))
    with pytest.raises(BackendUnavailableError, match=r"local rank 2 .* only 2 npu .*ASCEND_RT_VISIBLE_DEVICES='0,1'"):
        backend.set_device()


def test_a_visible_list_out_of_order_hides_every_npu_and_the_reason_says_so(make_fake_npu, clean_env) -> None:
    make_fake_npu(device_count=8)
    clean_env.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,0")  # torch_npu's device_count() is 0 for this
    reason = NPU.unavailable_reason()
    assert "no NPU is visible" in reason and "ASCEND_RT_VISIBLE_DEVICES='2,0'" in reason
    assert "unless the list is ascending" in reason


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


@pytest.mark.parametrize("ask", ["supports", "describe"])
def test_bf16_is_asked_only_on_the_process_s_own_device(make_fake_npu, ask: str) -> None:
    # torch.npu.is_bf16_supported() starts the runtime on the current device: asked before
    # set_device, every rank would start it on NPU 0 (`xshard env` and scripts ask before training)
    calls = make_fake_npu(device_count=8)
    backend = NPU(World(rank=5, world_size=8, local_rank=3, local_world_size=4))
    answer = backend.supports(torch.bfloat16) if ask == "supports" else backend.describe()["bf16"]
    assert answer is True
    assert calls.runtime_started_on == 3 and calls.runtime_started_by == "set_device"
    assert calls.bf16_questions == [3]
    assert calls.set_device == [3]


def test_the_accelerator_asks_after_binding_the_device(make_fake_npu, clean_env) -> None:
    import xshard

    calls = make_fake_npu(device_count=8)
    clean_env.setenv("LOCAL_RANK", "2")  # one process, bound to NPU 2
    acc = xshard.Accelerator(backend="npu", mixed_precision="bf16")
    assert acc.device == torch.device("npu", 2)
    assert calls.runtime_started_by == "set_device" and calls.runtime_started_on == 2
    assert calls.bf16_questions and set(calls.bf16_questions) == {2}


def test_autocast_enters_torch_s_own_npu_autocast(fake_npu) -> None:
    # torch.autocast("npu") itself asks torch.npu.get_amp_supported_dtype() (the fake has it, as torch_npu)
    with NPU(World()).autocast(torch.bfloat16):
        assert torch.is_autocast_enabled("npu")
        assert torch.get_autocast_dtype("npu") == torch.bfloat16
    assert not torch.is_autocast_enabled("npu")


def test_grad_scaler_is_torch_npu_s_own(fake_npu) -> None:
    scaler = NPU(World()).grad_scaler()
    assert isinstance(scaler, torch.npu.amp.GradScaler)
    assert fake_npu.grad_scalers == [{"init_scale": 2.0**16, "growth_interval": 2000, "dynamic": True, "enabled": True}]
    assert NPU(World()).grad_scaler(enabled=False).is_enabled() is False


def _scaled_steps(scaler, losses: list[float]) -> tuple[list[float], list[float]]:
    """SGD steps of w (starting at 1) on loss * w; returns w and the scale after each step."""
    w = torch.nn.Parameter(torch.ones(()))  # on the CPU: the fake device's tensors are CPU tensors
    opt = torch.optim.SGD([w], lr=0.1)
    ws, scales = [], []
    for loss in losses:
        opt.zero_grad()
        scaler.scale(w * loss).backward()
        scaler.step(opt)
        scaler.update()
        ws.append(w.item())
        scales.append(scaler.get_scale())
    return ws, scales


@pytest.mark.parametrize("inf_nan_mode", [True, False], ids=["910B-inf-nan", "910A-float-status"])
def test_torch_npu_scaler_skips_an_overflow_and_backs_off(make_fake_npu, inf_nan_mode: bool) -> None:
    calls = make_fake_npu(inf_nan_mode=inf_nan_mode)
    ws, scales = _scaled_steps(NPU(World()).grad_scaler(), [1.0, float("inf"), 1.0])
    assert ws == pytest.approx([0.9, 0.9, 0.8])  # the overflowing step is skipped
    assert scales == [2.0**16, 2.0**15, 2.0**15]
    # on chips without inf/nan mode torch_npu clears the float-status flag once per iteration
    assert calls.float_status_clears == (0 if inf_nan_mode else 3)


def test_visible_devices_are_sorted_for_hccl(fake_npu) -> None:
    env: dict[str, str] = {}
    assert apply_visible_devices(NPU, "6,2,4", env) == {"ASCEND_RT_VISIBLE_DEVICES": "2,4,6"}
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "2,4,6"}
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_probe_has_no_side_effects(fake_npu) -> None:
    before = dict(os.environ)
    assert NPU.unavailable_reason() is None
    assert NPU.runtime_initialized() is False
    assert fake_npu.runtime_started_on is None
    assert fake_npu.set_device == [] and fake_npu.synchronize == 0
    assert dict(os.environ) == before


def test_no_npu_visible_names_the_variable(make_fake_npu, clean_env) -> None:
    make_fake_npu(device_count=8)
    clean_env.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    reason = NPU.unavailable_reason()
    assert "no NPU is visible" in reason and "ASCEND_RT_VISIBLE_DEVICES=''" in reason


# ---------------------------------------------------------------- torch_npu missing or broken


def _pip_requirement(message: str) -> Requirement:
    found = re.search(r'pip install "(torch-npu==[^"]+)"', message)
    assert found, message
    return Requirement(found.group(1))


def test_explicit_npu_without_torch_npu(no_torch_npu) -> None:
    no_torch_npu.setenv("XSHARD_BACKEND", "npu")
    with pytest.raises(BackendUnavailableError) as err:
        select()
    message = str(err.value)
    assert "XSHARD_BACKEND=npu" in message
    assert "torch_npu is not installed" in message
    assert "set_env.sh" in message
    # the hint matches torch-npu's rebuilds of the same release (2.12.0.post3 for torch 2.12.0) too
    release = torch.__version__.split("+")[0]
    wanted = _pip_requirement(message)
    assert wanted.specifier.contains(release) and wanted.specifier.contains(f"{release}.post3")
    major, minor = (int(p) for p in release.split(".")[:2])
    assert not wanted.specifier.contains(f"{major}.{minor + 1}.0")


@pytest.mark.parametrize("variant,cause,fix", [
    ("no_cann", "ImportError: libhccl.so: cannot open shared object file", "set_env.sh"),
    ("cuda_torch", "RuntimeError: Two accelerators cannot be used at the same time", "CPU build of torch"),
])
def test_torch_npu_that_cannot_load_is_explained(clean_env, variant: str, cause: str, fix: str) -> None:
    clean_env.delitem(sys.modules, "torch_npu", raising=False)
    clean_env.syspath_prepend(str(BROKEN / variant))
    clean_env.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    reason = NPU.unavailable_reason()
    assert reason.startswith("torch_npu is installed but cannot load")
    assert cause in reason and fix in reason
    if variant == "no_cann":
        assert _pip_requirement(reason).specifier.contains(torch.__version__.split("+")[0])
    assert "torch_npu" not in sys.modules or sys.modules["torch_npu"] is None
    # torch_npu switches auto-loading off first thing; the failed import must not leave it off
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"
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
    out["ops"] = list(ops)

    # torch_npu's own scaler, rank 1 overflowing: on a 910A-class chip (no inf/nan mode) the scaler
    # all-reduces the overflow count itself, so both ranks skip; with inf/nan mode (910B) it does not
    # and each rank decides alone: agreeing is then the job of the code that uses the scaler.
    for inf_nan_mode in (False, True):
        scaler_calls = install_fake_torch_npu(device_count=world_size, inf_nan_mode=inf_nan_mode)
        ws, _ = _scaled_steps(backend.grad_scaler(), [float("inf") if rank == 1 else 1.0])
        out[f"stepped_inf_nan_{inf_nan_mode}"] = ws[0] != 1.0
        out[f"overflow_all_reduces_inf_nan_{inf_nan_mode}"] = scaler_calls.overflow_all_reduces
        # the sharded core's scaler is torch_npu's, made to share the verdict: both ranks skip, both back off
        sharded = ShardedGradScaler.for_backend(backend)
        ws, scales = _scaled_steps(sharded, [float("inf") if rank == 1 else 1.0, 1.0])
        out[f"sharded_inf_nan_{inf_nan_mode}"] = (isinstance(sharded, torch.npu.amp.GradScaler), ws, scales)
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
        assert out["ops"] == [str(dist.ReduceOp.AVG)]  # HCCL averages itself: no SUM-then-divide here
        assert out["stepped_inf_nan_False"] is False and out["overflow_all_reduces_inf_nan_False"] == 1
        assert out["stepped_inf_nan_True"] is (rank == 0) and out["overflow_all_reduces_inf_nan_True"] == 0
        for mode in (False, True):
            is_torch_npus, ws, scales = out[f"sharded_inf_nan_{mode}"]
            assert is_torch_npus
            assert ws == pytest.approx([1.0, 0.9]) and scales == [2.0**15, 2.0**15]  # same on both ranks
        assert out["initialized_after_teardown"] is False
