"""CUDA backend, emulated: torch.cuda's functions are patched on this CPU-only torch (tests/support/fakes/cuda.py,
held to this torch's signatures by tests/test_vendor_conformance.py) and record what the backend asks.
Proves how xshard drives CUDA, not that a GPU works (`xshard env --check`)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from support.fakes.cuda import fake_cuda

from xshard.backends import (
    BackendUnavailableError,
    VisibleDevicesError,
    World,
    apply_visible_devices,
    backend_class,
    communication,
    select,
)

CUDA = backend_class("cuda")


def test_this_cpu_build_is_reported_precisely(clean_env) -> None:
    reason = CUDA.unavailable_reason()
    assert f"this torch ({torch.__version__}) is built without CUDA" in reason
    assert f"pip install torch=={torch.__version__.split('+')[0]} --index-url" in reason
    with pytest.raises(BackendUnavailableError, match="XSHARD_BACKEND=cuda asks for the cuda backend.*without CUDA"):
        clean_env.setenv("XSHARD_BACKEND", "cuda")
        select()


def test_no_gpu_visible_mentions_cuda_visible_devices(clean_env) -> None:
    fake_cuda(clean_env, device_count=0)
    assert "CUDA_VISIBLE_DEVICES" not in CUDA.unavailable_reason()
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = CUDA.unavailable_reason()
    assert "built with CUDA 12.6 but no CUDA device is visible" in reason
    assert "CUDA_VISIBLE_DEVICES=''" in reason and "nvidia-smi" in reason


def test_identity_devices_and_set_device(clean_env) -> None:
    calls = fake_cuda(clean_env, device_count=2)
    assert CUDA.unavailable_reason() is None
    backend = CUDA(World(rank=5, world_size=6, local_rank=1, local_world_size=2))
    assert (backend.dist_backend, backend.visible_devices_env, backend.native_avg) == (
        "nccl", "CUDA_VISIBLE_DEVICES", True)
    assert backend.device() == torch.device("cuda", 1)
    backend.set_device()
    assert calls.set_device == [1]
    with pytest.raises(BackendUnavailableError, match=r"local rank 2 needs device 2, but only 2 cuda.*--nproc"):
        backend.set_device(2)


def test_process_group_binds_the_device_first_then_starts_nccl(clean_env) -> None:
    order = []
    fake_cuda(clean_env, device_count=4)
    clean_env.setattr(torch.cuda, "set_device", lambda i: order.append(("set_device", i)))
    clean_env.setattr(dist, "is_initialized", lambda: False)
    clean_env.setattr(dist, "init_process_group", lambda **kw: order.append(("init", kw)))
    # this process's first group (torch's own env:// rendezvous), whatever groups earlier tests of this worker
    # started: a later group would rendezvous in a store at MASTER_PORT, where no job listens here
    clean_env.setattr(communication._Generation, "started", 0)
    backend = CUDA(World(rank=3, world_size=4, local_rank=3, local_world_size=4))
    backend.init_process_group(timeout=90)
    assert order == [
        ("set_device", 3),
        ("init", {"backend": "nccl", "rank": 3, "world_size": 4, "timeout": datetime.timedelta(seconds=90),
                  "device_id": torch.device("cuda", 3)}),
    ]


@pytest.mark.parametrize("capability,bf16", [((8, 0), True), ((9, 0), True), ((7, 0), False), ((7, 5), False)],
                         ids=["A100", "H100", "V100", "T4"])
def test_bf16_means_the_gpu_computes_in_it(clean_env, capability, bf16: bool) -> None:
    # torch.cuda.is_bf16_supported() says yes on V100 and T4 too (it counts emulation by default)
    calls = fake_cuda(clean_env, capability=capability)
    backend = CUDA(World())
    assert backend.supports(torch.bfloat16) is bf16
    assert backend.supports(torch.float16)
    assert [q["including_emulation"] for q in calls.bf16_questions] == [False]
    if not bf16:
        with pytest.raises(ValueError, match="bfloat16 is not supported on this device.*float16"):
            backend.autocast(torch.bfloat16)


@pytest.mark.parametrize("ask", ["supports", "describe"])
def test_bf16_is_asked_only_on_the_process_s_own_gpu(clean_env, ask: str) -> None:
    # the answer is for the current GPU and starts CUDA there: bind this process's GPU first
    calls = fake_cuda(clean_env, device_count=4)
    backend = CUDA(World(rank=3, world_size=4, local_rank=3, local_world_size=4))
    assert (backend.supports(torch.bfloat16) if ask == "supports" else backend.describe()["bf16"]) is True
    assert calls.set_device == [3] and calls.runtime_started_on == 3
    assert [q["device"] for q in calls.bf16_questions] == [3]


def test_a_bound_process_is_not_bound_again(clean_env) -> None:
    calls = fake_cuda(clean_env, device_count=2)
    backend = CUDA(World(rank=1, world_size=2, local_rank=1, local_world_size=2))
    backend.set_device()
    backend.supports(torch.bfloat16)
    assert calls.set_device == [1]


def test_autocast_and_grad_scaler_use_cuda(clean_env) -> None:
    fake_cuda(clean_env)
    asked, built = [], []
    clean_env.setattr(torch, "autocast", lambda **kw: asked.append(kw))
    clean_env.setattr(torch.amp, "GradScaler", lambda device, enabled=True: built.append(device))
    backend = CUDA(World())
    backend.autocast(torch.float16)
    backend.grad_scaler()
    assert asked == [{"device_type": "cuda", "dtype": torch.float16}]
    assert built == ["cuda"]


def test_visible_devices_keep_the_user_order(clean_env) -> None:
    fake_cuda(clean_env)
    env: dict[str, str] = {}
    assert apply_visible_devices(CUDA, [3, 1], env) == {"CUDA_VISIBLE_DEVICES": "3,1"}


def test_visible_devices_refused_once_cuda_started(clean_env) -> None:
    fake_cuda(clean_env, initialized=True)
    with pytest.raises(VisibleDevicesError, match=r"CUDA_VISIBLE_DEVICES=0,1, but the cuda runtime has already started"):
        apply_visible_devices(CUDA, "0,1", {})
    # the value already in effect is fine even after start
    assert apply_visible_devices(CUDA, "0,1", {"CUDA_VISIBLE_DEVICES": "0,1"}) == {}
