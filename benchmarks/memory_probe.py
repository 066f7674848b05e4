"""Measure memory the same way for every framework in a benchmark process.

Two methods, both reported:
- ``live_tensor_bytes()``: the bytes of every distinct tensor storage that Python objects keep alive
  (found through the garbage collector, de-duplicated by storage). Measured once before the model is
  built and once at the peak of a step (after backward, before the optimizer step, when parameters,
  gradients and optimizer state all exist); the difference is the model state the framework holds,
  including its flat buffers. It cannot see tensors held only from C++ (DDP's reducer buckets, gloo's
  buffers); the benchmark runs DDP with ``gradient_as_bucket_view=True`` so its buckets are the
  gradients themselves and are seen.
- peak resident set size (VmHWM) during the timed steps, after resetting it at their start: everything
  the process touched, activations and communication buffers included.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import torch


def live_tensor_bytes() -> int:
    """Bytes of all distinct CPU tensor storages reachable from Python objects."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): never trips a module's lazy __getattr__
            continue
        try:
            storage = obj.untyped_storage()
            if storage.device.type != "cpu" or storage.nbytes() == 0:
                continue
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # wrapper subclasses (DTensor) have no real storage; their local tensors are counted
        seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def rss_bytes() -> int | None:
    """Resident set size now (Linux), or None where /proc is not available."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Start a new peak-RSS measurement (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the last reset (or process start)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024
