"""A fake torch_tpu (TorchTPU 0.2.0) and ``torch.tpu``, plus a test-only "tpu" process group over gloo.

``install_fake_torch_tpu()`` puts a ``torch_tpu`` package with its ``_loader.load`` entry point into
``sys.modules``; ``load()`` does what the real one does where it finds chips: registers ``torch.tpu``
and the "tpu" c10d backend (here delegating to gloo), and, with ``name_device=True``, renames
PrivateUse1 to "tpu" (permanent for the process: do that only in spawned workers, since the NPU fakes
name it "npu"). ``torch.accelerator``'s device functions are patched to answer for the fake chip,
as TorchTPU's C++ hooks make them do.

Held to the torch-tpu 0.2.0 wheel by tests/test_vendor_conformance.py:
- ``torch.tpu`` offers only names the wheel's ``torch.tpu`` exports, with the same parameters;
- the functions the wheel marks internal on this torch (``device_count``, ``set_device``, ...) raise
  RuntimeError when called from outside torch and torch_tpu, as the real ones do;
- "tpu" is registered with the same (non-extended) constructor shape as ``tpu_distributed.create_process_group``.
Deliberate differences, because the fake chip's tensors are CPU tensors: "tpu" serves CPU tensors
(``devices=["cpu"]``; TorchTPU registers ``["tpu"]``), generators are CPU generators.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

#: what the fake's ``torch.tpu`` refuses from callers outside torch and torch_tpu (the wheel marks
#: these internal on torch >= 2.11; get_rng_state and initial_seed on torch >= 2.13)
INTERNAL_SINCE = {"current_device": (2, 11), "set_device": (2, 11), "is_available": (2, 11),
                  "set_stream": (2, 11), "synchronize": (2, 11), "device_count": (2, 11),
                  "current_stream": (2, 11), "initial_seed": (2, 13), "get_rng_state": (2, 13)}
#: how the fake registers "tpu": TorchTPU's own call has devices=["tpu"] and no extended API
TPU_REGISTRATION: dict = {"devices": ["cpu"]}


@dataclass
class TPUCalls:
    """What the code under test asked of the fake TorchTPU."""

    launch_env_calls: list[dict] = field(default_factory=list)
    runtime_started: bool = False
    synchronize: int = 0
    refused: list[str] = field(default_factory=list)  # internal functions called from outside the framework


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _from_framework(depth: int = 2) -> bool:
    """Is the caller ``depth`` frames up in torch or torch_tpu (TorchTPU's rule for internal APIs)?"""
    module = sys._getframe(depth).f_globals.get("__name__", "")
    return module in ("torch", "torch_tpu") or module.startswith(("torch.", "torch_tpu."))


def _tpu_module(calls: TPUCalls, chips: int, index: int) -> types.ModuleType:
    mod = types.ModuleType("torch.tpu")
    generators = tuple(torch.Generator().manual_seed(1000 + i) for i in range(max(chips, 1)))

    def start() -> None:
        calls.runtime_started = True

    def internal(fn):
        since = INTERNAL_SINCE[fn.__name__]

        def guarded(*args, **kwargs):
            if _torch_version() >= since and not _from_framework():
                calls.refused.append(fn.__name__)
                raise RuntimeError(f"{fn.__name__} is internal to TorchTPU and can only be called by the PyTorch "
                                   "framework (torch and torch_tpu).")
            return fn(*args, **kwargs)

        guarded.__name__ = fn.__name__
        guarded.__wrapped__ = fn
        return guarded

    @internal
    def device_count():
        return chips

    @internal
    def set_device(device):
        if int(getattr(device, "index", device) or 0) != index:
            raise ValueError(f"Cannot set TPU device to index {device}, current process is bound to device index "
                             f"{index}. Changing the active TPU device within a process is not supported.")

    @internal
    def current_device():
        start()
        return index

    @internal
    def synchronize(device=None):
        calls.synchronize += 1

    @internal
    def is_available():
        return chips > 0

    @internal
    def get_rng_state(device="tpu"):
        return generators[index].get_state()

    def is_initialized():
        return calls.runtime_started

    def manual_seed(seed):
        generators[index].manual_seed(int(seed))

    def manual_seed_all(seed):
        for g in generators:
            g.manual_seed(int(seed))

    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16, torch.float32]

    for fn in (device_count, set_device, current_device, synchronize, is_available, get_rng_state,
               is_initialized, manual_seed, manual_seed_all, get_amp_supported_dtype):
        setattr(mod, fn.__name__, fn)
    mod.default_generators = generators
    mod.distributed = types.ModuleType("torch.tpu.distributed")
    mod.distributed.set_tpu_launch_env = _launch_env(calls, chips)
    return mod


def _launch_env(calls: TPUCalls, chips: int):
    def set_tpu_launch_env(*, nnodes=None, nproc_per_node=None):
        """Single host as TorchTPU does it: one slice-builder address per process, the topology."""
        calls.launch_env_calls.append({"nnodes": nnodes, "nproc_per_node": nproc_per_node})
        if chips == 0:
            raise ValueError("set_tpu_launch_env(): expected TPU devices, got none")
        count = nproc_per_node if nproc_per_node is not None else chips
        os.environ.setdefault("TORCH_TPU_XPROF_SESSION_ID", "1")
        os.environ.setdefault("TORCH_TPU_SLICEBUILDER_ADDRESSES",
                              ",".join(f"localhost:{8470 + i}" for i in range(count)))
        os.environ.setdefault("TORCH_TPU_TOPOLOGY", {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}[count])

    return set_tpu_launch_env


def _tpu_over_gloo(store, rank, size, timeout) -> dist.ProcessGroup:
    """The shape of ``tpu_distributed.create_process_group`` (non-extended), building a gloo group."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _patch_accelerator(calls: TPUCalls, chips: int, index: int) -> None:
    """torch.accelerator answering for the fake chip (the real TorchTPU serves it through C++ hooks)."""
    acc = torch.accelerator

    def device_count() -> int:
        return chips

    def current_device_index() -> int:
        calls.runtime_started = True
        return index

    def set_device_index(device, /) -> None:
        if int(getattr(device, "index", device) or 0) != index:
            raise ValueError("Changing the active TPU device within a process is not supported.")

    def synchronize(device=None, /) -> None:
        calls.synchronize += 1

    def memory_allocated(device_index=None, /) -> int:
        return 0

    def max_memory_allocated(device_index=None, /) -> int:
        return 0

    def reset_peak_memory_stats(device_index=None, /) -> None:
        """Nothing is allocated on the fake chip."""

    for fn in (device_count, current_device_index, set_device_index, synchronize, memory_allocated,
               max_memory_allocated, reset_peak_memory_stats):
        setattr(acc, fn.__name__, fn)


#: the torch.accelerator functions the fake replaces (restored by ``uninstall_fake_torch_tpu``)
PATCHED_ACCELERATOR = ("device_count", "current_device_index", "set_device_index", "synchronize",
                       "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
_saved_accelerator = {name: getattr(torch.accelerator, name) for name in PATCHED_ACCELERATOR}


def install_fake_torch_tpu(chips: int = 4, index: int = 0, name_device: bool = False,
                           autoload: bool = True) -> TPUCalls:
    """Make ``import torch_tpu`` answer like a TPU VM with ``chips`` chips, this process bound to ``index``.

    ``autoload=False``: as with TORCH_DEVICE_BACKEND_AUTOLOAD=0, importing it does not load it (torch.tpu
    appears once its ``_loader.load`` entry point is called).
    """
    calls = TPUCalls()
    package = types.ModuleType("torch_tpu")
    package.__path__ = []
    loader = types.ModuleType("torch_tpu._loader")

    def load() -> None:
        if hasattr(torch, "tpu") or chips == 0:  # the real one registers nothing without a TPU
            return
        if name_device and torch._C._get_privateuse1_backend_name() == "privateuseone":
            torch.utils.rename_privateuse1_backend("tpu")
        torch.tpu = _tpu_module(calls, chips, index)
        _patch_accelerator(calls, chips, index)
        if "tpu" not in dist.Backend.backend_list:
            dist.Backend.register_backend("tpu", _tpu_over_gloo, **TPU_REGISTRATION)

    loader.load = load
    package._loader = loader
    sys.modules["torch_tpu"], sys.modules["torch_tpu._loader"] = package, loader
    if autoload:
        load()
    return calls


def uninstall_fake_torch_tpu() -> None:
    """Undo ``install_fake_torch_tpu`` (a "tpu" c10d registration and a device name stay: torch keeps them)."""
    sys.modules.pop("torch_tpu", None)
    sys.modules.pop("torch_tpu._loader", None)
    if hasattr(torch, "tpu"):
        del torch.tpu
    for name, fn in _saved_accelerator.items():
        setattr(torch.accelerator, name, fn)

