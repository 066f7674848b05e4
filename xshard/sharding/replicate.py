"""ReplicatedEngine (stage 0, like DDP): every rank holds everything; gradients are averaged by bucketed all-reduce.

Trainable parameters are grouped into buckets of about ``bucket_size_mb`` in reverse registration
order (roughly the order backward produces their gradients). A post-accumulate-grad hook counts the
gradients that arrived; buckets are all-reduced asynchronously in bucket order as soon as they are
full and every earlier bucket is out, so every rank issues the same all-reduces in the same order
even when ranks use different parameters (data-dependent branches): a rank that lacks a gradient
only launches later, in the callback queued on the autograd engine that issues what never filled,
waits for everything and leaves the averages in ``param.grad``.

With a ``reduce_dtype`` other than the gradients' (the config's, or DDP's ``comm_hook`` FP16 / BF16) a
bucket is all-reduced in that dtype as torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` do it: the
gradients cast into the bucket, divided by the world size, summed, and cast back into ``param.grad``.

Unused parameters: each bucket carries one flag per parameter ("this rank had a gradient") in the
same all-reduce, so a parameter that no rank used keeps ``grad is None`` (as DDP with
``find_unused_parameters``), and one used on some ranks gets the average. The flags are read on the
host only when this rank lacked a gradient in that bucket.

``requires_grad`` is read at every forward: freezing or unfreezing a parameter rebuilds the buckets
(frozen parameters are in no bucket: no gradient, no traffic).

Each bucket's buffer is allocated once and reused every step, and after the reduce each ``param.grad``
is a view into it (as DDP's ``gradient_as_bucket_view``): no fresh bucket-sized allocation per step,
and with ``zero_grad(set_to_none=False)`` backward accumulates straight into the bucket, so even the
copy in is skipped. The price, as in DDP: a gradient tensor kept from one step is overwritten by the
next step's reduce (clone it to keep it).

A gradient that arrives with ``param.grad`` unset (``zero_grad()``'s default ``set_to_none=True``) is
copied into its bucket slice as soon as autograd has accumulated it, and ``param.grad`` becomes the
slice: one pass over the gradient, where pointing ``param.grad`` at a zeroed slice before
accumulation costs a fill and an add (three passes). Either way at most one gradient lives outside
the buckets at a time; later accumulations (a parameter used twice, ``no_sync`` micro-steps) add
straight into the slice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.autograd import Variable

from .engine import Engine
from .reduce import used_flags

if TYPE_CHECKING:  # types only: the core imports nothing of the device layer at run time
    from xshard.backends import Collectives, Handle


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # gradient elements; the flags follow them in ``flat``
    ready: int = 0
    handle: Handle | None = None
    flat: torch.Tensor | None = None  # the bucket's buffer, allocated on first use and kept
    all_used_here: bool = True
    arrived: set[int] = field(default_factory=set)
    #: id(param) -> the view of ``flat`` handed out as its ``.grad`` (identity, not data pointers:
    #: XLA tensors have none)
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    #: id(param) -> its slice of ``flat`` shaped as the parameter, cut once per ``flat`` (``_allocate``)
    #: and handed out as ``.grad`` every step: the same memory a fresh view would have, without the
    #: two views per parameter per step a fresh cut costs
    slices: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return len(self.arrived) == len(self.params)


class ReplicatedEngine(Engine):
    """Bucketed, overlapped gradient all-reduce for a replicated module."""

    def __init__(self, module: nn.Module, collectives: Collectives, bucket_size_mb: float,
                 reduce_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.module = module
        self.collectives = collectives
        self.reduce_dtype = reduce_dtype
        self.limit = int(bucket_size_mb * 2**20)
        self._callback_queued = False
        self._params = list(dict.fromkeys(module.parameters()))
        self._signature: tuple[bool, ...] = ()
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._next_launch = 0
        self._param_hooks: list = []
        self._build()
        self._root_hook = module.register_forward_pre_hook(self._pre_forward)

    # ------------------------------------------------------------------ buckets
    def _build(self) -> None:
        """Buckets over the parameters that want gradients now (rebuilt when that changes)."""
        for h in self._param_hooks:
            h.remove()
        params = [p for p in self._params if p.requires_grad]
        self._signature = tuple(p.requires_grad for p in self._params)
        current: list[nn.Parameter] = []
        self.buckets, size = [], 0
        for p in reversed(params):
            if current and (size + p.numel() * p.element_size() > self.limit or p.dtype != current[0].dtype):
                self.buckets.append(self._bucket(len(self.buckets), current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(self._bucket(len(self.buckets), current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._param_hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @staticmethod
    def _bucket(index: int, params: list[nn.Parameter]) -> _Bucket:
        offsets, pos = [], 0
        for p in params:
            offsets.append(pos)
            pos += p.numel()
        return _Bucket(index, params, offsets, pos)

    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: object) -> None:
        if tuple(p.requires_grad for p in self._params) != self._signature:
            self._build()

    def remove_hooks(self) -> None:
        for h in self._param_hooks:
            h.remove()
        self._param_hooks.clear()
        self._root_hook.remove()

    def shards_changed(self) -> None:
        """Nothing is cached: the parameters are the compute copies."""

    def zero_grad(self) -> None:
        """Gradients live only in ``param.grad``."""

    def full_params_context(self, writeback: bool = False) -> contextlib.AbstractContextManager:
        """Nothing to gather: the parameters are whole, and changes to them always stay."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ hooks
    @staticmethod
    def _allocate(bucket: _Bucket, dtype: torch.dtype) -> torch.Tensor:
        """Give ``bucket`` a buffer of ``dtype`` (its gradients, then one flag per parameter) and cut the
        parameters' slices of it (kept while the buffer is: a new buffer, after a change of the reduce
        dtype, cuts new ones)."""
        params = bucket.params
        flat = bucket.flat = torch.empty(bucket.numel + len(params), dtype=dtype, device=params[0].device)
        bucket.views.clear()
        bucket.slices = {id(p): flat[off:off + p.numel()].view_as(p)
                         for p, off in zip(params, bucket.offsets, strict=True)}
        return flat

    @torch.compiler.disable
    def _on_grad(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        if torch.is_grad_enabled():  # backward with create_graph: the copy must not join the graph
            with torch.no_grad():
                self._move_into_bucket(bucket, p)
        else:  # autograd runs hooks with gradients off: no context to enter, 192 times a step
            self._move_into_bucket(bucket, p)
        if not self.sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        bucket.arrived.add(id(p))
        # launch in bucket order, so that every rank issues the same all-reduces in the same order
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].full:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _move_into_bucket(self, bucket: _Bucket, p: nn.Parameter) -> None:
        """Make ``p.grad`` its slice of the bucket (copying the gradient autograd just stored)."""
        grad = p.grad
        if grad is None or grad is bucket.views.get(id(p)):
            return
        view = bucket.slices.get(id(p))
        if view is not None and view.dtype == grad.dtype:
            view.copy_(grad)
            p.grad = view
            bucket.views[id(p)] = view

    def _launch(self, bucket: _Bucket) -> None:
        dtype = self.reduce_dtype or bucket.params[0].dtype
        flat = bucket.flat if bucket.flat is not None and bucket.flat.dtype == dtype else self._allocate(bucket, dtype)
        used = [p.grad is not None for p in bucket.params]
        with torch.no_grad():
            for p in bucket.params:
                part = bucket.slices[id(p)]
                if p.grad is None:
                    part.zero_()
                elif p.grad is not bucket.views.get(id(p)):  # else the gradient already is its view of the bucket
                    part.copy_(p.grad)
            flat[bucket.numel:].copy_(used_flags(used, 1, dtype, flat.device))
        bucket.all_used_here = all(used)
        op = "avg"
        if dtype != bucket.params[0].dtype:
            # compressed (reduce_dtype, DDP's comm_hook FP16 / BF16): torch's compress hooks' arithmetic, so
            # the numbers are DDP's: cast, divide by the world size in the low dtype, sum, cast back at the end
            flat.div_(self.collectives.world_size)
            op = "sum"
        bucket.handle = self.collectives.all_reduce(flat, op=op, async_op=True,
                                                    tag=f"all-reduce of gradient bucket {bucket.index}")

    @torch.compiler.disable
    def _finish_backward(self) -> None:
        self._callback_queued = False
        while self._next_launch < len(self.buckets):  # buckets that never filled, in order
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        self._next_launch = 0
        with torch.no_grad():
            for bucket in self.buckets:
                assert bucket.handle is not None and bucket.flat is not None  # every bucket was launched
                bucket.handle.wait()
                flat = bucket.flat
                n = len(bucket.params)
                used = [True] * n if bucket.all_used_here else (flat[bucket.numel:] > 0).tolist()
                for p, was_used in zip(bucket.params, used, strict=True):
                    if not was_used:  # no rank produced a gradient: as plain PyTorch, no .grad
                        if p.grad is bucket.views.get(id(p)):
                            p.grad = None
                        bucket.views.pop(id(p), None)
                        continue
                    avg = bucket.slices[id(p)]
                    # the average replaces the local gradient (a view of the bucket when dtypes agree)
                    p.grad = avg if avg.dtype == p.dtype else avg.to(p.dtype)
                    if p.grad is avg:
                        bucket.views[id(p)] = avg
                    else:
                        bucket.views.pop(id(p), None)
                bucket.handle, bucket.arrived = None, set()
