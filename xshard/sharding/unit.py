"""A unit at run time: its parameters' shards, its full compute copies, its gather and reduce.

Each parameter has two faces:
- the user's ``nn.Parameter``: its ``.data`` is this rank's dim-0 shard (a view of a padded
  buffer), in the model's dtype, where the optimizer updates it and where the reduced gradient
  lands (``.grad``, same shape);
- a full compute ``nn.Parameter`` (param_dtype, on the compute device) that is swapped into
  ``module._parameters`` while the unit runs forward or backward, and swapped back afterwards,
  so ``model.parameters()`` outside forward/backward always yields the user's Parameters.

At stage 3 the full copy's storage is freed after use (``untyped_storage().resize_(0)``: the
tensor object autograd saved stays valid and is refilled before backward needs it); at stages 1-2
it stays resident and is refreshed only when a shard's ``_version`` shows the optimizer changed it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .layout import FlatLayout, ShardLayout
from .wrap import UnitSpec, param_owner_is_norm

SHARDED, GATHERING, GATHERED = "sharded", "gathering", "gathered"
_BYTE_ALIGN = 16  # alignment of segments in a mixed-dtype (byte) gather buffer


def plan_buffer(segs: list[int], dtypes: list[torch.dtype]) -> tuple[torch.dtype, FlatLayout]:
    """The dtype and layout of one flat buffer holding segments of ``segs`` elements of ``dtypes``.

    One dtype: a buffer of that dtype. Mixed dtypes (fp32 norms beside bf16 weights): a byte
    buffer whose segments are aligned so that each can be viewed as its own dtype.
    """
    kinds = set(dtypes)
    if len(kinds) <= 1:
        return (next(iter(kinds)) if kinds else torch.float32), FlatLayout.of(segs)
    sizes = [n * torch.empty((), dtype=d).element_size() for n, d in zip(segs, dtypes, strict=True)]
    return torch.uint8, FlatLayout.of(sizes, align=_BYTE_ALIGN)


def segment(flat_or_grid: torch.Tensor, layout: FlatLayout, i: int, dtype: torch.dtype) -> torch.Tensor:
    """Segment ``i`` of a flat buffer (1-D) or of an all-gather output viewed ``(world_size, row)``."""
    off, size = layout.offsets[i], layout.sizes[i]
    seg = flat_or_grid[..., off:off + size]
    return seg.view(dtype) if flat_or_grid.dtype == torch.uint8 and dtype != torch.uint8 else seg


@dataclass
class Runtime:
    """What every unit of one sharded model shares."""

    collectives: object
    rank: int
    world_size: int
    device: torch.device  # compute device
    shard_device: torch.device  # where master shards, gradient shards and optimizer state live
    stage: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    keep_norms_fp32: bool
    frees_storage_by_resize: bool = True
    #: stage 0 with compute copies: shards are the whole parameter (world of 1 for gathers) and
    #: gradients are averaged with an all-reduce over these collectives instead of reduce-scattered
    replicate_over: object = None


def rehome(spec, data: torch.Tensor) -> nn.Parameter:
    """Make the user's Parameter hold ``data`` (its shard, or itself on the compute device).

    ``param.data = data`` keeps the Parameter object, so optimizers built earlier stay valid. A
    tensor type that cannot take another's data in place (a CPU Parameter and an XLA tensor) gets a
    new Parameter in every place that registered the old one, with a warning: on such devices build
    the optimizer after sharding, or move the model to ``backend.device()`` first.
    """
    p = spec.param
    if p.is_meta:  # meta-parameter hook (see materialize.py): nothing can hold a meta Parameter usefully yet
        return _replace_param(spec, data)
    if torch._has_compatible_shallow_copy_type(p, data):
        p.data = data
        return p
    warnings.warn(  # one message per device pair, not one per parameter
        f"parameters on {p.device.type} cannot take data on {data.device.type} in place, so they were replaced "
        "by new Parameters: an optimizer built before sharding holds the old ones. Move the model to "
        "backend.device() before sharding (or build the optimizer after)", stacklevel=4)
    return _replace_param(spec, data)


def _replace_param(spec, data: torch.Tensor) -> nn.Parameter:
    """A new Parameter holding ``data``, registered in every place the old one was."""
    new = nn.Parameter(data, requires_grad=spec.param.requires_grad)
    for module, attr in spec.places:
        module._parameters[attr] = new
    spec.param = new
    return new


class ShardedParam:
    """One parameter of a unit: the user's shard-holding Parameter and the full compute copy."""

    def __init__(self, spec, rt: Runtime, gather_dtype: torch.dtype) -> None:
        p = spec.param
        self.spec = spec
        self.user: nn.Parameter = p
        self.layout = ShardLayout.of(p.shape, rt.world_size, rt.rank)
        self.dtype = p.dtype
        self.gather_dtype = gather_dtype
        self.trainable = p.requires_grad
        g = self.layout
        #: elements of the gather target: ``world_size`` padded shards (>= numel when dim 0 does
        #: not divide by the world size); the full parameter is its first ``numel`` elements
        self.gather_numel = rt.world_size * g.seg
        with torch.no_grad():
            self.padded = torch.zeros(g.seg, dtype=p.dtype, device=rt.shard_device)
            # Meta-parameter hook: a parameter on the meta device has no values yet; its shard is
            # allocated (zeros) and filled afterwards by xshard.sharding.materialize.
            if not p.is_meta:
                start = rt.rank * g.seg
                self.padded[: g.local_numel].copy_(p.detach().reshape(-1)[start:start + g.local_numel])
            flat = torch.empty(self.gather_numel, dtype=gather_dtype, device=rt.device)
            full = flat[: g.numel].view(g.shape)
            if rt.stage < 3 and not p.is_meta:  # stages 1-2 keep the full copy resident; start from local values
                full.copy_(p.detach())
            self.full = nn.Parameter(full, requires_grad=p.requires_grad)
            self.user = rehome(spec, self.padded[: g.local_numel].view(g.local_shape))
        self.full_bytes = self.gather_numel * self.full.element_size()
        # Where all-gathers write: the full parameter's own storage seen flat, padding included.
        # It is a separate tensor object (own version counter), so refilling a storage that
        # autograd saved in forward does not look like an in-place change to the saved tensor.
        # Devices that free by replacing ``.data`` get a fresh target per gather instead.
        self.gather_target: torch.Tensor | None = None
        if rt.frees_storage_by_resize:
            self.gather_target = torch.empty(0, dtype=gather_dtype, device=rt.device).set_(
                self.full.untyped_storage(), 0, (self.gather_numel,))

    def version(self) -> int:
        return self.user._version

    def swap(self, use_full: bool) -> None:
        """Register the full copy (or the user's Parameter) wherever the model registers this parameter."""
        target = self.full if use_full else self.user
        for module, attr in self.spec.places:
            module._parameters[attr] = target


class Unit:
    """The parameters of one module, gathered and reduced together (one collective operation each)."""

    def __init__(self, spec: UnitSpec, rt: Runtime, is_root: bool) -> None:
        self.module = spec.module
        self.name = spec.name or "<root>"
        self.is_root = is_root
        self.rt = rt
        self.params: list[ShardedParam] = []
        for ps in spec.params:
            dtype = rt.param_dtype or ps.param.dtype
            if rt.keep_norms_fp32 and param_owner_is_norm(ps) and ps.param.is_floating_point():
                dtype = torch.float32
            if not ps.param.is_floating_point():
                dtype = ps.param.dtype
            self.params.append(ShardedParam(ps, rt, dtype))
        self.trainable = [sp for sp in self.params if sp.trainable]
        self.reduce_dtype = rt.reduce_dtype or rt.param_dtype
        self.reduce_layout = FlatLayout.of([sp.layout.seg for sp in self.trainable])
        self.state = GATHERED if rt.stage < 3 else SHARDED
        self.stamp = self.versions() if rt.stage < 3 else None
        # True when the full copies may not match the shards: at stages 1-2 they start from this
        # rank's own values, so the first forward gathers (ranks agree even without
        # sync_module_states); also set when shards are written behind the version counters
        self.stale = rt.stage in (1, 2)
        self._pending = None  # (handle, gather targets) while GATHERING
        # per-step bookkeeping, reset at the end of each backward
        self.pending_backward_calls = 0
        self.backward_done = False
        self.in_backward = False  # between its pre-backward and its post-backward
        if rt.stage == 3:
            for sp in self.params:
                self._free(sp)

    # ------------------------------------------------------------------ state
    def versions(self) -> tuple[int, ...]:
        return tuple(sp.version() for sp in self.params)

    def needs_gather(self) -> bool:
        if self.state == SHARDED:
            return True
        if self.state == GATHERED:
            return self.stale or self.stamp != self.versions()
        return False

    # ------------------------------------------------------------------ gather
    def start_gather(self) -> None:
        """Issue this unit's all-gather (asynchronous); ``wait_gather`` completes it.

        Each parameter is gathered straight into its full copy's storage: this rank's shard is
        written (cast to the compute dtype) into its own slice, which is the all-gather's input, so
        there is no send buffer and no receive buffer to copy out of (the collectives may still pack
        where one large operation is cheaper, e.g. NCCL).
        """
        if not self.params or not self.needs_gather():
            return
        rt = self.rt
        targets, inputs = [], []
        with torch.no_grad():
            for sp in self.params:
                seg = sp.layout.seg
                if sp.gather_target is not None:
                    self._alloc(sp)
                    target = sp.gather_target
                    own = target[rt.rank * seg:(rt.rank + 1) * seg]
                    own.copy_(sp.padded, non_blocking=True)
                else:  # the full copy takes the target's data once the gather is done
                    target = torch.empty(sp.gather_numel, dtype=sp.gather_dtype, device=rt.device)
                    own = sp.padded.to(device=rt.device, dtype=sp.gather_dtype)
                targets.append(target)
                inputs.append(own)
        handle = rt.collectives.all_gather_into_tensors(targets, inputs, async_op=True)
        self._pending = (handle, targets)
        self.stamp = self.versions()
        self.stale = False
        self.state = GATHERING

    def wait_gather(self) -> None:
        """Make the full parameters usable: finish an in-flight gather, or gather now."""
        if self.state != GATHERING:
            if not self.needs_gather():
                return
            self.start_gather()
            if self.state != GATHERING:
                return
        handle, targets = self._pending
        self._pending = None
        handle.wait()
        if not self.rt.frees_storage_by_resize:
            for sp, target in zip(self.params, targets, strict=True):
                sp.full.data = target[: sp.layout.numel].view(sp.layout.shape)
        self.state = GATHERED

    def reshard(self) -> None:
        """Free the full copies (stage 3 only; stages 1-2 keep them resident)."""
        if self.rt.stage < 3 or self.state == SHARDED:
            return
        if self.state == GATHERING:
            self.wait_gather()
        for sp in self.params:
            self._free(sp)
        self.state = SHARDED

    def _free(self, sp: ShardedParam) -> None:
        if self.rt.frees_storage_by_resize:
            sp.full.untyped_storage().resize_(0)
        else:  # devices without resizable storage (XLA): drop the data, keep the Parameter object
            sp.full.data = torch.empty(0, dtype=sp.gather_dtype, device=self.rt.device)

    def _alloc(self, sp: ShardedParam) -> None:
        storage = sp.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(sp.full_bytes)

    def live_full_bytes(self, sp: ShardedParam) -> int:
        """Bytes of ``sp``'s full compute copy allocated right now (0 when freed)."""
        if self.rt.frees_storage_by_resize:
            return sp.full.untyped_storage().size()
        return sp.full.numel() * sp.full.element_size()

    # ------------------------------------------------------------------ swap
    def swap_in(self) -> None:
        for sp in self.params:
            sp.swap(True)

    def swap_out(self) -> None:
        for sp in self.params:
            sp.swap(False)

    # ------------------------------------------------------------------ reduce
    def start_reduce(self) -> PendingReduce | None:
        """Hand the full gradients to the reduce-scatter (asynchronous) and drop them from the full copies.

        A gradient already in the reduce dtype, contiguous and of ``world_size`` whole shards is
        the reduce's input itself (the collectives may reduce it in place): no packing buffer.
        Only padded or cast gradients are copied, into a zero-padded buffer of their own.
        """
        if not self.trainable:
            return None
        rt = self.rt
        dtype = self.reduce_dtype or self.trainable[0].dtype
        if rt.replicate_over is not None:
            return self._start_all_reduce(dtype)
        inputs, outputs = [], []
        with torch.no_grad():
            for sp in self.trainable:
                inputs.append(_reduce_input(sp.full.grad, sp.gather_numel, dtype, rt.device))
                outputs.append(torch.empty(sp.layout.seg, dtype=dtype, device=rt.device))
                sp.full.grad = None
        comm = rt.collectives
        op, pre, post = _divide_factors(dtype, comm.world_size)
        if pre != 1.0:
            for t in inputs:
                t.div_(pre)
        handle = comm.reduce_scatter_tensors(outputs, inputs, op=op, async_op=True)
        return PendingReduce(self, handle, outputs, inputs, post)

    def _start_all_reduce(self, dtype: torch.dtype) -> PendingReduce:
        """Stage 0 with compute copies: average the unit's whole gradients in one flat all-reduce."""
        rt = self.rt
        buf = torch.empty(self.reduce_layout.row_numel, dtype=dtype, device=rt.device)
        with torch.no_grad():
            for off, sp in zip(self.reduce_layout.offsets, self.trainable, strict=True):
                block = buf[off:off + sp.layout.seg]
                grad = sp.full.grad
                if grad is None:
                    block.zero_()
                else:
                    block.copy_(grad.reshape(-1))
                sp.full.grad = None
        comm = rt.replicate_over
        op, pre, post = _divide_factors(dtype, comm.world_size)
        if pre != 1.0:
            buf.div_(pre)
        handle = comm.all_reduce(buf, op=op, async_op=True)
        outs = [buf[off:off + sp.layout.seg] for off, sp in zip(self.reduce_layout.offsets, self.trainable, strict=True)]
        return PendingReduce(self, handle, outs, [buf], post)

    def accumulate_grads(self, outs: list[torch.Tensor]) -> None:
        """Add this rank's reduced shard of every trainable parameter's gradient to ``param.grad``."""
        with torch.no_grad():
            for out, sp in zip(outs, self.trainable, strict=True):
                shard = out[: sp.layout.local_numel].view(sp.layout.local_shape)
                # blocking: an asynchronous device-to-host copy could still be running when the
                # optimizer reads an offloaded gradient
                shard = shard.to(device=sp.user.device, dtype=sp.dtype)
                if sp.user.grad is None:
                    sp.user.grad = shard  # a view of ``out``, which nothing else reuses
                else:
                    sp.user.grad.add_(shard)


def _reduce_input(grad: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reduce-scatter input for one full gradient: the gradient itself when it already is
    ``numel`` contiguous elements of ``dtype`` on ``device``, else a zero-padded copy."""
    if grad is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    if grad.numel() == numel and grad.dtype == dtype and grad.device == device and grad.is_contiguous():
        return grad.view(-1)
    buf = torch.empty(numel, dtype=dtype, device=device)
    buf[: grad.numel()].copy_(grad.reshape(-1))
    buf[grad.numel():].zero_()
    return buf


def _divide_factors(dtype: torch.dtype, world_size: int) -> tuple[str, float, float]:
    """(op, pre-divide, post-divide) for a gradient average.

    fp16 sums of N gradients can overflow: divide by ~sqrt(N) before and the rest after (as
    PyTorch FSDP does). Other dtypes use the collectives' "avg" (native where the backend has it,
    SUM then divide otherwise).
    """
    if dtype == torch.float16 and world_size > 1:
        pre = 1.0
        while world_size % (pre * 2) == 0 and world_size / (pre * 2) >= pre * 2:
            pre *= 2
        return "sum", pre, world_size / pre
    return "avg", 1.0, 1.0


@dataclass
class PendingReduce:
    """A reduce-scatter in flight and the buffers it needs until it completes."""

    unit: Unit
    handle: object
    outs: list[torch.Tensor]  # one reduced shard per trainable parameter
    inputs: list[torch.Tensor]  # kept alive until the collective is done with them
    post_divide: float

    def finish(self) -> None:
        self.handle.wait()
        if self.post_divide != 1.0:
            for out in self.outs:
                out.div_(self.post_divide)
        self.unit.accumulate_grads(self.outs)
