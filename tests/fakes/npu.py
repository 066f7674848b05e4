"""A fake torch_npu (and ``torch.npu``) plus a test-only "hccl" process group over gloo.

``install_fake_torch_npu()`` puts a recording ``torch_npu`` into ``sys.modules`` and a recording
``torch.npu`` onto torch, the way ``import torch_npu`` does, and registers "hccl" as a c10d backend
that delegates to gloo (the real torch_npu registers its HCCL there). The NPU code path then starts
a REAL process group under the name "hccl" and runs real collectives on CPU tensors.

Usable from a pytest fixture (``uninstall()`` afterwards) and from spawned worker processes.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

FAKE_VERSION = "2.13.0.post0+fake"


@dataclass
class NPUCalls:
    """What the backend asked of the fake runtime, in order."""

    set_device: list[int] = field(default_factory=list)
    synchronize: int = 0
    grad_scalers: list[dict[str, Any]] = field(default_factory=list)


class FakeGradScaler:
    """Stands in for torch.npu.amp.GradScaler; records how it was built."""

    def __init__(self, calls: NPUCalls, **kwargs: Any) -> None:
        self.kwargs = kwargs
        calls.grad_scalers.append(kwargs)


def _npu_module(calls: NPUCalls, device_count: int, bf16: bool, initialized: bool, with_amp: bool):
    mod = types.ModuleType("torch.npu")
    state = {"current": 0, "initialized": initialized}

    def set_device(index: int) -> None:
        if not 0 <= int(index) < device_count:
            raise RuntimeError(f"fake npu: invalid device {index}")
        calls.set_device.append(int(index))
        state["current"] = int(index)
        state["initialized"] = True

    def synchronize(device: Any = None) -> None:
        calls.synchronize += 1

    mod.device_count = lambda: device_count
    mod.is_available = lambda: device_count > 0
    mod.is_bf16_supported = lambda: bf16
    mod.is_initialized = lambda: state["initialized"]
    mod.set_device = set_device
    mod.current_device = lambda: state["current"]
    mod.synchronize = synchronize
    mod.memory_allocated = lambda device=None: 0
    mod.max_memory_allocated = lambda device=None: 0
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.get_rng_state = lambda device="npu": torch.get_rng_state()
    mod.set_rng_state = lambda state_, device="npu": None
    # torch.manual_seed seeds every named device module through these two
    mod.manual_seed_all = lambda seed: None
    mod._is_in_bad_fork = lambda: False
    if with_amp:
        mod.amp = types.SimpleNamespace(GradScaler=lambda **kw: FakeGradScaler(calls, **kw))
    return mod


def name_npu_device_type() -> None:
    """Let torch.device("npu", i) parse, as torch_npu does by renaming PrivateUse1 (permanent)."""
    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")


def register_hccl_over_gloo() -> None:
    """Register a c10d backend named "hccl" that is really gloo (once per process)."""
    if "hccl" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        "hccl",
        lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),
        devices=["cpu"],
    )


def install_fake_torch_npu(
    device_count: int = 8,
    bf16: bool = True,
    initialized: bool = False,
    with_amp: bool = True,
    register_hccl: bool = True,
) -> NPUCalls:
    """Make ``import torch_npu`` and ``torch.npu`` answer like an NPU machine; returns the call log."""
    calls = NPUCalls()
    vendor = types.ModuleType("torch_npu")
    vendor.__version__ = FAKE_VERSION
    vendor.npu = _npu_module(calls, device_count, bf16, initialized, with_amp)
    sys.modules["torch_npu"] = vendor
    torch.npu = vendor.npu
    name_npu_device_type()
    if register_hccl:
        register_hccl_over_gloo()
    return calls


def uninstall_fake_torch_npu() -> None:
    """Undo ``install_fake_torch_npu`` as far as torch allows.

    The hccl registration and the "npu" device-type name stay (torch cannot undo them), and once
    PrivateUse1 is named "npu", torch looks up ``torch.npu`` whenever it asks a device module about
    every backend (autocast, checkpointing): deleting it would break later tests in this process. So
    ``torch.npu`` becomes an inert module of a machine with no NPU instead.
    """
    sys.modules.pop("torch_npu", None)
    if torch._C._get_privateuse1_backend_name() == "npu":
        torch.npu = _npu_module(NPUCalls(), device_count=0, bf16=False, initialized=False, with_amp=False)
    elif hasattr(torch, "npu"):
        del torch.npu
