"""A fake torch_npu (and ``torch.npu``) plus a test-only "hccl" process group over gloo.

``install_fake_torch_npu()`` puts a recording ``torch_npu`` into ``sys.modules`` and a recording
``torch.npu`` onto torch, the way ``import torch_npu`` does, and registers "hccl" as a c10d backend
the way torch_npu does (the extended constructor) but delegating to gloo. The NPU code path then
starts a REAL process group under the name "hccl" and runs real collectives on CPU tensors.

The fake offers only names the real ``torch_npu.npu`` has, with the same parameters, and keeps the
side effects xshard relies on (tests/test_vendor_conformance.py checks both against the real wheel):
- the runtime starts lazily (``_lazy_init``) on the current device, from ``set_device`` and from the
  functions whose real versions call ``_lazy_init`` (``is_bf16_supported``, ``current_device``, ...);
  ``calls.runtime_started_on`` records the device it started on;
- ``device_count()`` reads ASCEND_RT_VISIBLE_DEVICES as torch_npu does (0 for a list that is not
  ascending, cut at the first device that does not exist), and is cached once the runtime runs;
- the RNG state is a per-device generator's, separate from torch's CPU generator;
- ``amp.GradScaler`` is modelled on torch_npu's: its constructor (``dynamic=``), the float-status
  flag cleared in ``scale()`` on chips without inf/nan mode, an overflow verdict kept in
  ``_has_overflow`` that alone decides ``update()``, and the overflow count all-reduced over the
  default group on those chips.
Deliberate differences, because the fake device's tensors are CPU tensors: streams and events
complete at once; the scaler accepts CPU tensors (torch_npu's refuses anything not on an NPU);
"hccl" serves CPU tensors (``devices=["cpu"]``, torch_npu registers ``["npu"]``).

Usable from a pytest fixture (``uninstall()`` afterwards) and from spawned worker processes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

FAKE_VERSION = "2.13.0.post0+fake"

#: how the fake registers "hccl": torch_npu's own call has extended_api=True, devices=["npu"]
HCCL_REGISTRATION: dict[str, Any] = {"extended_api": True, "devices": ["cpu"]}


@dataclass
class NPUCalls:
    """What the backend asked of the fake runtime, in order."""

    set_device: list[int] = field(default_factory=list)
    synchronize: int = 0
    #: the device the runtime started on (None: not started), and what started it
    runtime_started_on: int | None = None
    runtime_started_by: str | None = None
    bf16_questions: list[int] = field(default_factory=list)  # the current device at each question
    grad_scalers: list[dict[str, Any]] = field(default_factory=list)
    float_status_clears: int = 0
    overflow_all_reduces: int = 0


def visible_device_count(visible: str | None, chips: int) -> int:
    """How many devices torch_npu's ``device_count()`` reports for ASCEND_RT_VISIBLE_DEVICES=``visible``."""
    if visible is None:
        ids = list(range(64))
    else:
        digits = ""
        for ch in visible:  # torch_npu reads up to the first character that is neither a digit nor ","
            if not (ch.isdigit() or ch == ","):
                break
            digits += ch
        ids = []
        for part in digits.split(",") if digits else []:
            if not part:
                break
            ids.append(int(part))
    for i, dev in enumerate(ids):
        if i > 0 and dev <= ids[i - 1]:
            return 0  # the runtime needs an ascending list
        if dev >= chips:
            return i
    return len(ids)


class _Runtime:
    """The state of the fake NPU runtime: started or not, current device, generators."""

    def __init__(self, calls: NPUCalls, chips: int, bf16: bool, inf_nan_mode: bool, initialized: bool) -> None:
        self.calls, self.chips, self.bf16, self.inf_nan_mode = calls, chips, bf16, inf_nan_mode
        self.initialized = initialized
        self.current: int | None = 0 if initialized else None
        self.cached_count: int | None = None
        self.generators: dict[int, torch.Generator] = {}

    def lazy_init(self, by: str) -> None:
        if self.initialized:
            return
        self.initialized = True
        self.current = 0 if self.current is None else self.current
        self.calls.runtime_started_on, self.calls.runtime_started_by = self.current, by

    def device_count(self) -> int:
        if self.cached_count is not None:
            return self.cached_count
        count = visible_device_count(os.environ.get("ASCEND_RT_VISIBLE_DEVICES"), self.chips)
        if self.initialized:
            self.cached_count = count
        return count

    def generator(self, device: Any) -> torch.Generator:
        index = _index(device, self)
        if index not in self.generators:
            self.generators[index] = torch.Generator().manual_seed(67280421310721 + index)
        return self.generators[index]


def _index(device: Any, rt: _Runtime) -> int:
    if isinstance(device, torch.device):
        device = device.index
    elif isinstance(device, str):  # "npu" or "npu:1" (parsed here: torch parses "npu" only once it is named)
        device = int(device.partition(":")[2]) if ":" in device else None
    if device is None:
        rt.lazy_init("current_device")
        return int(rt.current or 0)
    return int(device)


class FakeGradScaler(torch.amp.GradScaler):
    """torch_npu's ``torch.npu.amp.GradScaler``, modelled (see the module docstring).

    Like torch_npu's, its constructor does not call ``torch.amp.GradScaler.__init__`` (there is no
    ``_device`` attribute) and ``update()`` follows ``_has_overflow`` only. ``_rt`` is bound per install.
    """

    _rt: _Runtime

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 dynamic=True, enabled=True):
        self._rt.calls.grad_scalers.append(
            {"init_scale": init_scale, "growth_interval": growth_interval, "dynamic": dynamic, "enabled": enabled})
        self._enabled = enabled
        if enabled:
            if growth_factor <= 1.0 or backoff_factor >= 1.0:
                raise ValueError("The growth factor must be > 1.0 and the backoff factor < 1.0.")
            self._init_scale, self._scale = init_scale, None
            self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
            self._growth_interval, self._dynamic = growth_interval, dynamic
            self._init_growth_tracker, self._growth_tracker = 0, None
            self._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)
            self._has_overflow = False
            self._clear_overflow_flag = False
            self._dist_initialized = False
            self._dist_overflow_count = None

    def scale(self, outputs):
        if not self._enabled:
            return outputs
        if self._dist_overflow_count is None:
            self._dist_initialized = dist.is_initialized()
            self._dist_overflow_count = torch.zeros(1)
        if self._dynamic and not self._clear_overflow_flag:
            if not self._rt.inf_nan_mode:
                self._rt.calls.float_status_clears += 1  # npu_clear_float_status on the real chip
            self._clear_overflow_flag = True
        return super().scale(outputs)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if self._dynamic and any(t.item() > 0 for t in per_device.values()):
            self._has_overflow = True
        self._sync_dist_overflow_count()
        if self._has_overflow:
            found_inf.add_(1)
        return per_device

    def _sync_dist_overflow_count(self):
        if self._rt.inf_nan_mode or not (self._dynamic and self._dist_initialized):
            return
        self._dist_overflow_count.fill_(1.0 if self._has_overflow else 0.0)
        dist.all_reduce(self._dist_overflow_count)
        self._rt.calls.overflow_all_reduces += 1
        if self._dist_overflow_count.item() != 0:
            self._has_overflow = True
        self._dist_overflow_count.zero_()

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()) and not self._has_overflow:
            return optimizer.step(*args, **kwargs)
        return None

    def update(self, new_scale=None):
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = torch.full((), float(new_scale), dtype=torch.float32)
        elif self._dynamic:
            if self._has_overflow:
                self._scale.mul_(self._backoff_factor)
                self._growth_tracker.zero_()
            else:
                self._growth_tracker.add_(1)
                if int(self._growth_tracker.item()) == self._growth_interval:
                    grown = self._scale * self._growth_factor
                    if not torch.isinf(grown):
                        self._scale = grown
                    self._growth_tracker.zero_()
        self._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)
        self._has_overflow = False
        self._clear_overflow_flag = False

    def state_dict(self):
        state = super().state_dict()
        if self._enabled:
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return
        super().load_state_dict(state_dict)
        self._dynamic = state_dict["dynamic"]


class FakeStream:
    """``torch.npu.Stream`` on a device whose work completes at once (a deliberate difference)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        return super().__new__(cls)

    def wait_event(self, event):
        """Nothing to wait for."""

    def wait_stream(self, stream):
        """Nothing to wait for."""

    def record_event(self, event=None):
        return event if event is not None else FakeEvent()

    def query(self):
        return True

    def synchronize(self):
        """Already done."""


class FakeEvent:
    """``torch.npu.Event`` on a device whose work completes at once (a deliberate difference)."""

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        return super().__new__(cls)

    def record(self, stream=None):
        """Recorded at once."""

    def wait(self, stream=None):
        """Nothing to wait for."""

    def query(self):
        return True

    def synchronize(self):
        """Already done."""


def _npu_module(calls: NPUCalls, device_count: int, bf16: bool, initialized: bool, inf_nan_mode: bool):
    """The fake ``torch.npu`` of a machine with ``device_count`` chips."""
    mod = types.ModuleType("torch.npu")
    rt = _Runtime(calls, device_count, bf16, inf_nan_mode, initialized)

    def _lazy_init():
        rt.lazy_init("_lazy_init")

    def is_initialized():
        return rt.initialized

    def device_count():
        return rt.device_count()

    def is_available():
        return rt.device_count() > 0

    def set_device(device):
        index = _index(device, rt)
        if not 0 <= index < rt.device_count():
            raise RuntimeError(f"fake npu: invalid device {index}")
        calls.set_device.append(index)
        rt.current = index
        rt.lazy_init("set_device")  # the real one starts the runtime (npu_lazy_init), then binds

    def current_device():
        rt.lazy_init("current_device")
        return rt.current

    def get_device_name(device_name=None):
        # the names torch_npu reports: a bf16 chip is a 910B, the one without bf16 the 910A class
        return "Ascend910B2" if rt.bf16 else "Ascend910A"

    def is_bf16_supported(including_emulation: bool = False):
        rt.lazy_init("is_bf16_supported")
        calls.bf16_questions.append(rt.current)
        return rt.bf16

    def get_amp_supported_dtype():
        if is_bf16_supported():
            return [torch.float16, torch.bfloat16, torch.float32]
        return [torch.float16, torch.float32]

    def synchronize(device=None):
        rt.lazy_init("synchronize")
        calls.synchronize += 1

    def memory_allocated(device=None):
        return 0

    def max_memory_allocated(device=None):
        return 0

    def reset_peak_memory_stats(device=None):
        """Nothing is allocated on the fake device."""

    def get_rng_state(device="npu"):
        return rt.generator(device).get_state()

    def set_rng_state(new_state, device="npu"):
        rt.generator(device).set_state(new_state)

    def manual_seed(seed):
        rt.generator("npu").manual_seed(int(seed))

    def manual_seed_all(seed):  # torch.manual_seed seeds every named device module through this
        for index in range(rt.chips):
            rt.generator(index).manual_seed(int(seed))

    def _is_in_bad_fork():
        return False

    def current_stream(device=None):
        rt.lazy_init("current_stream")
        return FakeStream()

    def default_stream(device=None):
        rt.lazy_init("default_stream")
        return FakeStream()

    def stream(stream):
        return contextlib.nullcontext(stream)

    def is_support_inf_nan():
        rt.lazy_init("is_support_inf_nan")
        return rt.inf_nan_mode

    for fn in (_lazy_init, is_initialized, device_count, is_available, set_device, current_device,
               is_bf16_supported, get_device_name, get_amp_supported_dtype, synchronize, memory_allocated, max_memory_allocated,
               reset_peak_memory_stats, get_rng_state, set_rng_state, manual_seed, manual_seed_all,
               _is_in_bad_fork, current_stream, default_stream, stream):
        setattr(mod, fn.__name__, fn)
    mod.Stream, mod.Event = FakeStream, FakeEvent
    mod.amp = types.ModuleType("torch.npu.amp")
    mod.amp.GradScaler = type("GradScaler", (FakeGradScaler,), {"_rt": rt})
    mod.utils = types.ModuleType("torch.npu.utils")
    mod.utils.is_support_inf_nan = is_support_inf_nan
    return mod


def name_npu_device_type() -> None:
    """Let torch.device("npu", i) parse, as torch_npu does by renaming PrivateUse1 (permanent)."""
    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        torch.utils.rename_privateuse1_backend("npu")


def _hccl_over_gloo(dist_backend_opts: Any, pg_options: Any) -> dist.ProcessGroup:
    """torch_npu's extended constructor shape, building a gloo group instead of an HCCL one."""
    return dist.ProcessGroupGloo(dist_backend_opts.store, dist_backend_opts.group_rank,
                                 dist_backend_opts.group_size, dist_backend_opts.timeout)


def register_hccl_over_gloo() -> None:
    """Register a c10d backend named "hccl" that is really gloo (once per process)."""
    if "hccl" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("hccl", _hccl_over_gloo, **HCCL_REGISTRATION)


def install_fake_torch_npu(
    device_count: int = 8,
    bf16: bool = True,
    initialized: bool = False,
    inf_nan_mode: bool = True,
    register_hccl: bool = True,
) -> NPUCalls:
    """Make ``import torch_npu`` and ``torch.npu`` answer like a machine with ``device_count`` chips.

    ``bf16``: the chip computes in bf16 (910B and later); ``inf_nan_mode``: it reports overflow as
    inf/nan (910B and later; the 910A class sets a float-status flag instead).
    """
    calls = NPUCalls()
    vendor = types.ModuleType("torch_npu")
    vendor.__version__ = FAKE_VERSION
    vendor.npu = _npu_module(calls, device_count, bf16, initialized, inf_nan_mode)
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
        torch.npu = _npu_module(NPUCalls(), device_count=0, bf16=False, initialized=False, inf_nan_mode=True)
    elif hasattr(torch, "npu"):
        del torch.npu
