"""Count the bytes every torch.distributed collective is asked to move, in the calling process.

``install()`` replaces the collective functions of ``torch.distributed`` (and of
``torch.distributed.distributed_c10d``, which some libraries call directly) with wrappers that add the
tensor sizes to a counter and then call the original. It must run before a library imports the
functions into its own namespace (DeepSpeed keeps references), so a worker calls it first.

Convention (the ZeRO paper's, the same as xshard's own counter, so the numbers compare): all-gather
counts its output (the full tensor), reduce-scatter its input (the full tensor), all-reduce twice its
tensor (it is a reduce-scatter plus an all-gather), broadcast / reduce / send / all-to-all their
tensor once. Only the outermost call counts: where one torch function calls another (a deprecated
name forwarding to a new one), the inner call is not counted again.

What it cannot see: collectives issued from C++ (DDP's gradient reducer, DDP's initial broadcast).
Those are reported from theory by the benchmark, and marked as such.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: function name -> (index of the argument that holds the counted tensors, factor)
_COUNTED: dict[str, tuple[int, int]] = {
    "all_reduce": (0, 2),
    "all_reduce_coalesced": (0, 2),
    "all_gather": (0, 1),
    "all_gather_into_tensor": (0, 1),
    "all_gather_single": (0, 1),
    "_all_gather_base": (0, 1),
    "all_gather_coalesced": (0, 1),
    "reduce_scatter": (1, 1),
    "reduce_scatter_tensor": (1, 1),
    "reduce_scatter_single": (1, 1),
    "_reduce_scatter_base": (1, 1),
    "broadcast": (0, 1),
    "reduce": (0, 1),
    "all_to_all": (1, 1),
    "all_to_all_single": (1, 1),
    "send": (0, 1),
    "isend": (0, 1),
    "scatter": (1, 1),
    "gather": (0, 1),
}

_local = threading.local()
_lock = threading.Lock()
bytes_by_op: dict[str, int] = defaultdict(int)
calls_by_op: dict[str, int] = defaultdict(int)
_installed = False


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _wrap(name: str, fn, index: int, factor: int):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def counting(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        if depth == 0:
            try:
                values = list(sig.bind(*args, **kwargs).arguments.values())
                counted = factor * _nbytes(values[index]) if index < len(values) else 0
            except TypeError:  # let the real function raise its own error
                counted = 0
            with _lock:
                bytes_by_op[name] += counted
                calls_by_op[name] += 1
        _local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = depth

    counting.__wrapped_for_counting__ = True
    return counting


def install() -> None:
    """Wrap the collectives (idempotent)."""
    global _installed
    if _installed:
        return
    for name, (index, factor) in _COUNTED.items():
        original = getattr(c10d, name, None) or getattr(dist, name, None)
        if original is None or getattr(original, "__wrapped_for_counting__", False):
            continue
        wrapped = _wrap(name, original, index, factor)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)
    _installed = True


def reset() -> None:
    """Zero the counters."""
    with _lock:
        bytes_by_op.clear()
        calls_by_op.clear()


def snapshot() -> dict[str, dict[str, int]]:
    """``{"bytes": {op: n}, "calls": {op: n}}`` since the last reset."""
    with _lock:
        return {"bytes": dict(bytes_by_op), "calls": dict(calls_by_op)}
