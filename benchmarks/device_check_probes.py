"""The device check's probes: host syncs by source line, and what the profiler says the device did.

- ``SyncCounter``: on a GPU (an NPU where torch_npu has it) torch's sync debug mode, each sync's warning put
  on the innermost frame of xshard's code; on the CPU the device-reading calls xshard's code makes
  (``tests/support/host_reads.py``);
- ``idle_share``: the share of wall time no kernel runs on the device; ``copy_overlap``: the share of
  host-to-device copy time that a compute kernel overlaps (both from ``torch.profiler``; None on the CPU).
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "tests") not in sys.path:
    sys.path.insert(1, str(HERE.parent / "tests"))  # support.host_reads, the CPU form's counter


def synchronize(device: torch.device) -> None:
    """Wait for the device's queue (nothing on the CPU): the end of a timed region."""
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None:
        module.synchronize(device)


class SyncCounter:
    """While entered and ``counting``: host syncs by source line, xshard's (``xshard``) and the rest (``other``)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self._counting = device, False
        self._reads: Any = None  # support.host_reads.HostReads where the reading calls are counted
        self.xshard: Counter[str] = Counter()
        self.other: Counter[str] = Counter()
        self.method = ""
        self._exit: Callable[[], None] = lambda: None

    def __enter__(self) -> SyncCounter:
        module = getattr(torch, self.device.type, None)
        set_mode = getattr(module, "set_sync_debug_mode", None) if self.device.type != "cpu" else None
        if set_mode is None:  # the CPU (or a device without the mode): count the reading calls themselves
            from support.host_reads import HostReads

            self._reads = HostReads()
            self._reads.counting = self._counting
            self._reads.__enter__()
            self.method = "calls of item/tolist/cpu/__bool__/nonzero/... made directly by xshard's frames"
            return self
        self.method = f"torch.{self.device.type}.set_sync_debug_mode('warn'), innermost frame in xshard"
        catcher = warnings.catch_warnings()
        catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._on_warning
        set_mode("warn")

        def leave() -> None:
            set_mode("default")
            catcher.__exit__(None, None, None)

        self._exit = leave
        return self

    @property
    def counting(self) -> bool:
        """Whether syncs are counted now (the steps after the warm-up)."""
        return self._counting

    @counting.setter
    def counting(self, value: bool) -> None:
        self._counting = value
        if self._reads is not None:
            self._reads.counting = value

    # Design note: a warning raised on autograd's device thread (in a backward hook) can reach Python only after
    # backward ends, on the thread that called it; such a sync is then put on xshard's backward call, not on the
    # hook's line. It still counts as xshard's, so the goal of 0 stays checked; only its line is coarser.
    def _on_warning(self, message: Any, category: type[Warning], filename: str, lineno: int, *rest: Any) -> None:
        if not self.counting or "synchroniz" not in str(message):
            return
        from support.host_reads import ROOTS

        frames = [f for f in traceback.extract_stack() if f.filename not in (warnings.__file__, __file__)]
        mine = [f for f in frames if os.path.realpath(f.filename).startswith(ROOTS)]
        if mine:
            where = os.path.relpath(os.path.realpath(mine[-1].filename), HERE.parent)
            self.xshard[f"{where}:{mine[-1].lineno} ({mine[-1].name})"] += 1
        else:
            outside = [f for f in frames if "torch" not in f.filename] or frames
            self.other[f"{Path(outside[-1].filename).name}:{outside[-1].lineno}"] += 1

    def __exit__(self, *exc: Any) -> None:
        if self._reads is not None:
            self._reads.__exit__(None, None, None)
            self.xshard.update(self._reads.where)
        self._exit()


# ------------------------------------------------------------------------------------------- profiler
def device_intervals(prof: Any, device: torch.device) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every event the profiler saw run on the device."""
    kind = {"cuda": "CUDA", "npu": "PrivateUse1"}.get(device.type)
    wanted = getattr(torch.autograd.DeviceType, kind) if kind else None
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if wanted is not None and e.device_type == wanted]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profiled(step: Callable[[], None], device: torch.device, steps: int) -> tuple[Any, float] | None:
    """Run ``steps`` steps under torch.profiler with the device's activity; (profile, wall s), None on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    activity = {"cuda": getattr(ProfilerActivity, "CUDA", None),
                "npu": getattr(ProfilerActivity, "PrivateUse1", None)}.get(device.type)
    if activity is None:
        return None
    with profile(activities=[ProfilerActivity.CPU, activity]) as prof:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall = time.perf_counter() - start
    return prof, wall


def idle_share(step: Callable[[], None], device: torch.device, steps: int = 2) -> float | str:
    """1 - (time some kernel runs on the device) / wall time, over ``steps`` profiled steps."""
    run = profiled(step, device, steps)
    if run is None:
        return "not applicable on the CPU (no device queue to idle)"
    prof, wall = run
    busy = union_length([(a, b) for _, a, b in device_intervals(prof, device)]) / 1e6
    return round(max(0.0, 1 - busy / wall), 4) if busy else "the profiler saw no device events"


def copy_overlap(step: Callable[[], None], device: torch.device, steps: int = 2) -> float | str:
    """The share of host-to-device copy time during which a compute kernel runs too."""
    run = profiled(step, device, steps)
    if run is None:
        return "not applicable on the CPU (no host-to-device copies)"
    events = device_intervals(run[0], device)
    copies = [(a, b) for name, a, b in events if "htod" in name.lower().replace(" ", "")]
    kernels = [(a, b) for name, a, b in events if "memcpy" not in name.lower() and "memset" not in name.lower()]
    if not copies:
        return "the profiler saw no host-to-device copies"
    copy_time = union_length(copies)
    overlapped = sum(union_length([(max(a, c), min(b, d)) for c, d in kernels if min(b, d) > max(a, c)])
                     for a, b in copies)
    return round(overlapped / copy_time, 4) if copy_time else 0.0
