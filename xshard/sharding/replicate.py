"""Stage 0 (NO_SHARD, DDP-like): every rank holds everything; gradients are averaged by bucketed all-reduce.

Trainable parameters are grouped into buckets of about ``bucket_size_mb`` in reverse registration
order (roughly the order backward produces their gradients). A post-accumulate-grad hook counts
the gradients that arrived; a full bucket is copied into its buffer and all-reduced
asynchronously while backward goes on. A callback queued on the autograd engine issues the
buckets that never filled (parameters unused in this step), waits for all of them and leaves the
averages in ``param.grad``. Frozen parameters are in no bucket.

Each bucket's buffer is allocated once and reused every step, and after the reduce each
``param.grad`` is a view into it (as DDP's ``gradient_as_bucket_view``): no fresh bucket-sized
allocation per step, and with ``zero_grad(set_to_none=False)`` backward accumulates straight into
the bucket, so even the copy in is skipped. The price, as in DDP: a gradient tensor kept from one
step is overwritten by the next step's reduce (clone it to keep it).
"""

from __future__ import annotations

import functools
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
    flat: torch.Tensor | None = None  # the bucket's buffer, allocated on first use and kept
    post_divide: float = 1.0
    arrived: set[int] = field(default_factory=set)
    #: id(param) -> the view of ``flat`` handed out as its ``.grad`` (identity, not data pointers:
    #: XLA tensors have none)
    views: dict[int, torch.Tensor] = field(default_factory=dict)


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
        self._offset_of: dict[int, int] = {}
        for b in self.buckets:
            offset = 0
            for p in b.params:
                self._offset_of[id(p)] = offset
                offset += p.numel()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._hooks += [p.register_hook(functools.partial(self._before_accumulate, p)) for p in params]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _before_accumulate(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Point a missing ``p.grad`` at its (zeroed) slice of the bucket before autograd accumulates.

        Autograd then adds the incoming gradient into the bucket and drops it, instead of keeping
        it as ``p.grad`` until the bucket is reduced: at most one gradient lives outside the
        buckets at a time (the peak drops by the model's gradient size under
        ``zero_grad(set_to_none=True)``), and ``_launch`` has nothing to copy.
        """
        if p.grad is not None:
            return
        view = self._bucket_view(p)
        if view is not None and view.dtype == grad.dtype:
            p.grad = view.zero_()
            self._bucket_of[id(p)].views[id(p)] = view

    def _bucket_view(self, p: nn.Parameter) -> torch.Tensor | None:
        bucket = self._bucket_of[id(p)]
        if bucket.flat is None or bucket.flat.dtype != p.dtype:
            return None
        offset = self._offset_of[id(p)]
        return bucket.flat[offset:offset + p.numel()].view_as(p)

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
        if bucket.flat is None:
            bucket.flat = torch.empty(sum(p.numel() for p in bucket.params), dtype=dtype,
                                      device=bucket.params[0].device)
        flat = bucket.flat
        with torch.no_grad():
            offset = 0
            for p in bucket.params:
                part = flat[offset:offset + p.numel()]
                offset += p.numel()
                if p.grad is None:
                    part.zero_()
                elif p.grad is not bucket.views.get(id(p)):  # else the gradient already is its view of the bucket
                    part.copy_(p.grad.reshape(-1))
        op, pre, post = _divide_factors(dtype, self.collectives.world_size)
        if pre != 1.0:
            flat.div_(pre)
        bucket.post_divide = post
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
                    if p.grad is avg:
                        bucket.views[id(p)] = avg
                    else:
                        bucket.views.pop(id(p), None)
                bucket.handle, bucket.arrived = None, set()
