"""Stage 0 (NO_SHARD, DDP-like): every rank holds everything; gradients are averaged by bucketed all-reduce.

Trainable parameters are grouped into buckets of about ``bucket_size_mb`` in reverse registration
order (roughly the order backward produces their gradients). A post-accumulate-grad hook counts
the gradients that arrived; a full bucket is flattened into one buffer and all-reduced
asynchronously while backward goes on. A callback queued on the autograd engine issues the
buckets that never filled (parameters unused in this step), waits for all of them and copies the
averages back into ``param.grad``. Frozen parameters are in no bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd import Variable

from .unit import _divide_factors


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: int = 0
    handle: object = None
    flat: torch.Tensor | None = None
    post_divide: float = 1.0
    arrived: set[int] = field(default_factory=set)


class Replicator:
    """Bucketed, overlapped gradient all-reduce for a replicated module."""

    def __init__(self, module: nn.Module, collectives, bucket_size_mb: float,
                 reduce_dtype: torch.dtype | None) -> None:
        self.collectives = collectives
        self.reduce_dtype = reduce_dtype
        self.sync = True
        self._callback_queued = False
        params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        limit = int(bucket_size_mb * 2**20)
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            if current and (size + p.numel() * p.element_size() > limit or p.dtype != current[0].dtype):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(_Bucket(current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        bucket = self._bucket_of[id(p)]
        if id(p) in bucket.arrived:
            return
        bucket.arrived.add(id(p))
        if len(bucket.arrived) == len(bucket.params) and bucket.handle is None:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        dtype = self.reduce_dtype or bucket.params[0].dtype
        device = bucket.params[0].device
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device)
                 for p in bucket.params]
        flat = torch.cat([t.to(dtype) for t in parts])
        op, pre, post = _divide_factors(dtype, self.collectives.world_size)
        if pre != 1.0:
            flat.div_(pre)
        bucket.flat, bucket.post_divide = flat, post
        bucket.handle = self.collectives.all_reduce(flat, op=op, async_op=True)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for bucket in self.buckets:  # fixed order: unfilled buckets are issued the same way on every rank
            if bucket.handle is None:
                self._launch(bucket)
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.handle.wait()
                if bucket.post_divide != 1.0:
                    bucket.flat.div_(bucket.post_divide)
                offset = 0
                for p in bucket.params:
                    avg = bucket.flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    # the average replaces the local gradient (a view of the bucket when dtypes agree)
                    p.grad = avg if avg.dtype == p.dtype else avg.to(p.dtype)
                bucket.handle, bucket.flat, bucket.arrived = None, None, set()
