"""``sync_module_states``: every rank takes rank 0's parameters and buffers, in a few broadcasts.

The tensors are packed per dtype into buckets of one fixed size (``BUCKET_BYTES``, or the largest
tensor when that is bigger), each bucket broadcast through the compute device (NCCL/HCCL cannot send
host tensors) and read back to the host once. Every bucket of a dtype has the same shape (the last
one is zero-padded), so a compiling device (XLA) compiles one graph per dtype, not one per tensor
(a broadcast per tensor made one graph per tensor shape); device memory stays one bucket, not the
model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # types only: the core imports nothing of the device layer at run time
    from xshard.backends import Collectives

#: the most bytes broadcast at once (a bucket), unless one tensor is larger
BUCKET_BYTES = 128 << 20


def _buckets(tensors: list[torch.Tensor], capacity: int) -> Iterator[list[torch.Tensor]]:
    """``tensors`` (one dtype) in order, in runs of at most ``capacity`` elements."""
    run: list[torch.Tensor] = []
    filled = 0
    for t in tensors:
        if run and filled + t.numel() > capacity:
            yield run
            run, filled = [], 0
        run.append(t)
        filled += t.numel()
    if run:
        yield run


def sync_module_states(module: nn.Module, collectives: Collectives, device: torch.device, mark_step: Callable[[], None]) -> None:
    """Broadcast rank 0's parameters and buffers to every rank (see the module docstring).

    ``mark_step`` (the backend's) cuts the graph after each broadcast: on XLA:CPU the replica threads
    meet there before compiling it (a read alone would compile and run it unaligned).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in list(dict.fromkeys(module.parameters())) + list(module.buffers()):
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, tensors in by_dtype.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            capacity = max(BUCKET_BYTES // itemsize, max(t.numel() for t in tensors))
            for bucket in _buckets(tensors, capacity):
                flat = torch.zeros(capacity, dtype=dtype, device=device)
                offset = 0
                for t in bucket:
                    flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
                    offset += t.numel()
                collectives.broadcast(flat, src=0, tag=f"broadcast of rank 0's initial {dtype} weights")
                mark_step()
                # one read of the whole bucket: on XLA each read of a piece would run the broadcast again
                host = flat.cpu()
                offset = 0
                for t in bucket:
                    t.copy_(host[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
