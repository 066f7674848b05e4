"""State dicts of a sharded model: full ones by default, this rank's pieces on request.

``model.state_dict()`` (of the prepared model, and of the user's own module inside it, which
``unwrap_model`` returns) has the user's names and whole shapes, exactly as before sharding, so
``save_pretrained`` and PEFT's ``save_pretrained`` write correct files with no extra argument. It is
a collective: every rank must call it. Units are gathered in fixed-size buckets to the CPU (peak
memory is one bucket beyond the result); tied parameters appear under each of their names, as the same tensor;
parameters are gathered in their own dtype (the fp32 master values, not the compute copies). With
``state_dict_rank0_only`` only rank 0 gets the tensors (others get an empty dict, as PyTorch FSDP's
``rank0_only``): save with ``is_main_process=accelerator.is_main_process`` then.

``load_state_dict`` takes a full state dict (each rank keeps its rows) or this rank's pieces
(``sharded_state_dict``). Both are done by hooks on the user's module, so every caller of
``state_dict()`` gets the same answer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .layout import rows_of, unpack_rows
from .unit import Unit, plan_buffer, segment

#: the most bytes of one rank's rows gathered at once (a bucket of units), unless one unit has more
GATHER_BUCKET_BYTES = 64 << 20
_ROW_ALIGN = 16  # elements: each unit's row starts aligned in a bucket (byte buffers view it as wider dtypes)


def _gather_buckets(units: list[Unit], device_is_compiled: bool, keep: bool,
                    mark_step: Any) -> dict[int, torch.Tensor]:
    """id(user Parameter) -> full CPU tensor for every parameter of ``units`` (empty if not ``keep``).

    Units' rows are packed, per buffer dtype, into buckets of one fixed size, each gathered with one
    all-gather: peak memory is one bucket (``world_size`` times ``GATHER_BUCKET_BYTES``, or the dtype's
    rows when fewer), not the model.
    On a compiled device (XLA) the bucket is packed on the host and sent as data, so every bucket of a
    dtype is the same graph (an all-gather of a fixed-size input): a save compiles one graph per dtype,
    not one per unit. ``mark_step`` (the backend's) runs right after each all-gather: each later read
    would otherwise re-run the pending graph, collective included, on this rank alone.
    """
    planned: dict[torch.dtype, list[tuple[Unit, Any]]] = {}
    for unit in units:
        if unit.params:
            dtype, layout = plan_buffer([sp.layout.seg for sp in unit.params], [sp.dtype for sp in unit.params])
            planned.setdefault(dtype, []).append((unit, layout))
    full: dict[int, torch.Tensor] = {}
    for dtype, entries in planned.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        # a bucket as large as the whole dtype's rows when they are fewer (a small model allocates no
        # 64 MiB per rank); still one size per dtype, so still one graph per dtype on XLA
        needed = sum(_aligned(layout.row_numel) for _, layout in entries)
        capacity = _aligned(max(min(GATHER_BUCKET_BYTES // itemsize, needed),
                                max(layout.row_numel for _, layout in entries)))
        bucket: list[tuple[Unit, Any]] = []
        filled = 0
        for unit, layout in entries:
            if bucket and filled + layout.row_numel > capacity:
                full.update(_gather_bucket(bucket, dtype, capacity, device_is_compiled, keep, mark_step))
                bucket, filled = [], 0
            bucket.append((unit, layout))
            filled += _aligned(layout.row_numel)
        full.update(_gather_bucket(bucket, dtype, capacity, device_is_compiled, keep, mark_step))
    return full


def _aligned(n: int) -> int:
    return -(-n // _ROW_ALIGN) * _ROW_ALIGN


def _gather_bucket(bucket: list[tuple[Unit, Any]], dtype: torch.dtype, capacity: int, device_is_compiled: bool,
                   keep: bool, mark_step: Any) -> dict[int, torch.Tensor]:
    """One all-gather of the rows of the units in ``bucket`` (see ``_gather_buckets``)."""
    rt = bucket[0][0].rt
    staging = torch.device("cpu") if device_is_compiled else rt.device
    send = torch.zeros(capacity, dtype=dtype, device=staging)
    offsets = []
    offset = 0
    with torch.no_grad():
        for unit, layout in bucket:
            row = send[offset:offset + layout.row_numel]
            for i, sp in enumerate(unit.params):
                # the whole padded shard (what the unit's own gathers send): on XLA one copy of device
                # data, where a view of it (the user's Parameter) would be a small graph to compile
                segment(row, layout, i, sp.dtype).copy_(sp.padded)  # 1-D; no view (a view is a graph on XLA)
            offsets.append(offset)
            offset += _aligned(layout.row_numel)
    send = send.to(rt.device)
    recv = torch.empty(capacity * rt.world_size, dtype=dtype, device=rt.device)
    names = ", ".join(unit.name for unit, _ in bucket)
    rt.collectives.all_gather_into_tensor(recv, send, tag=f"state-dict gather of units {names}")
    mark_step()
    if not keep:
        return {}
    grid = recv.cpu().view(rt.world_size, capacity)  # one read of the whole bucket (a view first would compile)
    out = {}
    for (unit, layout), start in zip(bucket, offsets, strict=True):
        rows = grid[:, start:start + layout.row_numel]
        for i, sp in enumerate(unit.params):
            full = torch.empty(sp.layout.shape, dtype=sp.dtype, device="cpu")
            unpack_rows(segment(rows, layout, i, sp.dtype), full.view(-1))
            out[id(sp.user)] = full
    return out


def _param_keys(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters(remove_duplicate=False))


def tie_partners(module: nn.Module) -> dict[str, list[str]]:
    """Each name of a tied parameter -> its other names (``lm_head.weight`` -> ``[model.embed_tokens.weight]``).

    A tied weight is one tensor, so files written from a tied model may hold it under one name only
    (safetensors refuses to store it twice; Accelerate and transformers keep one name), and which
    name depends on the writer: loading accepts either.
    """
    names: dict[int, list[str]] = {}
    for key, p in _param_keys(module).items():
        names.setdefault(id(p), []).append(key)
    return {key: [k for k in group if k != key] for group in names.values() if len(group) > 1 for key in group}


def fill_tied_keys(state_dict: dict[str, Any], partners: dict[str, list[str]]) -> dict[str, Any]:
    """``state_dict`` with every tied name it lacks filled from a partner it has (the same tensor)."""
    out = dict(state_dict)
    for key, others in partners.items():
        if key not in out:
            source = next((k for k in others if k in state_dict), None)
            if source is not None:
                out[key] = state_dict[source]
    return out


class StateDictHooks:
    """The hooks that make the user's module's ``state_dict``/``load_state_dict`` speak whole tensors.

    ``raw()`` suspends them, for the core's own reads of the shards (checkpoints, accounting).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._suspended = 0
        module = model.module
        # partials, not bound methods: torch marks hooks registered through its public API with an
        # attribute, which a bound method cannot take
        self._handles = [
            module.register_state_dict_post_hook(functools.partial(StateDictHooks._post_state_dict, self)),
            module.register_load_state_dict_pre_hook(functools.partial(StateDictHooks._pre_load, self)),
            module.register_load_state_dict_post_hook(functools.partial(StateDictHooks._post_load, self)),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def raw(self) -> Iterator[None]:
        """Inside the block, ``state_dict()`` returns the live shards (no collective)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _post_state_dict(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: dict[str, Any]) -> None:
        if self._suspended or not self.model.units:
            return
        keep = not self.model.options.state_dict_rank0_only or self.model.collectives.rank == 0
        full = gather_full_params(self.model, keep)
        if not keep:
            state_dict.clear()
            return
        by_key = _param_keys(module)
        for key in list(state_dict):
            name = key[len(prefix):] if key.startswith(prefix) else key
            p = by_key.get(name)
            if p is not None and id(p) in full:
                state_dict[key] = full[id(p)]
            elif isinstance(state_dict[key], torch.Tensor):
                state_dict[key] = state_dict[key].detach().to("cpu")

    def _pre_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                  strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Whole tensors become this rank's rows (pieces already of the shard's shape pass through)."""
        if self._suspended:
            return
        layouts = {id(view.param): view.layout for view in self.model.sharded_params()}
        for name, p in _param_keys(module).items():
            key = prefix + name
            value = state_dict.get(key)
            layout = layouts.get(id(p))
            if layout is None or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) == tuple(layout.shape) and tuple(value.shape) != tuple(layout.local_shape):
                state_dict[key] = layout.local_rows(value.detach())
            elif tuple(value.shape) == tuple(layout.shape) == tuple(layout.local_shape):
                state_dict[key] = value  # world of one: the whole tensor is the shard

    def _post_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        self.model.shards_changed()


def gather_full_params(model: Any, keep: bool) -> dict[int, torch.Tensor]:
    """id(user Parameter) -> full CPU tensor of every sharded parameter; every rank must call it."""
    return _gather_buckets(model.units, model.backend.compiles_graphs, keep, model.backend.mark_step)


def full_state_dict(model: Any, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """See ``ShardedModel.full_state_dict``."""
    keep = not rank0_only or model.collectives.rank == 0
    module = model.module
    full = gather_full_params(model, keep)
    if not keep:
        return {}
    by_key = _param_keys(module)
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}  # a tied (replicated) parameter is copied once, for all its names
    with model.raw_state_dict():
        entries = module.state_dict()
    for key, value in entries.items():
        p = by_key.get(key)
        if p is not None and id(p) in full:
            out[key] = full[id(p)]
        elif p is not None:
            out[key] = copies.setdefault(id(p), value.detach().to("cpu", copy=True))
        else:
            out[key] = value.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(model: Any, state_dict: dict[str, torch.Tensor]) -> None:
    """See ``ShardedModel.load_full_state_dict``: keys must match exactly (a tied weight under either
    of its names is enough); each rank keeps its rows."""
    module = model.module
    state_dict = fill_tied_keys(state_dict, tie_partners(module))
    with model.raw_state_dict():
        expected = set(module.state_dict().keys())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise KeyError(
            f"state dict does not match the model: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )
    layouts = {id(view.param): view.layout for view in model.sharded_params()}
    by_key = _param_keys(module)
    for key, value in state_dict.items():
        p = by_key.get(key)
        if p is None:
            continue
        want = layouts[id(p)].shape if id(p) in layouts else p.shape
        if tuple(value.shape) != tuple(want):
            raise ValueError(f"state dict entry {key!r} has shape {tuple(value.shape)}, the model's "
                             f"parameter has {tuple(want)}")
    module.load_state_dict(state_dict, strict=True)


# ---------------------------------------------------------------------- local (per-rank) pieces
#
# A "piece" is the dim-0 row range of one state-dict entry that this rank holds. Sharded parameters
# hold rows ``ShardLayout.start:stop``; everything else (buffers, stage-0 parameters) is replicated,
# so its piece is every row and only rank 0 needs to write it. 0-dim tensors are viewed as one row.
# With hybrid sharding every shard exists once per shard group (replica): only the first replica's
# ranks write theirs, so a checkpoint holds each row once. ``writes`` says whether this rank is the
# one to write a piece. Checkpoints store and reassemble these pieces by rows, which is what lets a
# checkpoint written on W ranks (in any shard groups) load on any other number of ranks.


class LocalPiece:
    """Rows ``[start, stop)`` of state-dict entry ``key`` (full shape ``shape``) held by this rank."""

    __slots__ = ("key", "shape", "start", "stop", "tensor", "sharded", "writes")

    def __init__(self, key: str, shape: tuple[int, ...], start: int, stop: int, tensor: torch.Tensor,
                 sharded: bool, writes: bool) -> None:
        self.key, self.shape, self.start, self.stop = key, shape, start, stop
        self.tensor = tensor  # the live tensor (the user's Parameter or buffer), shape (stop - start, *rest)
        self.sharded = sharded
        self.writes = writes  # this rank writes the piece (its rows are held by no rank written before it)


def local_pieces(model: Any) -> dict[str, LocalPiece]:
    """Every key of ``module.state_dict()`` -> the piece this rank holds (tied keys share one tensor)."""
    module = model.module
    layouts = {id(view.param): view.layout for view in model.sharded_params()}
    by_key = _param_keys(module)
    out: dict[str, LocalPiece] = {}
    with model.raw_state_dict():
        entries = module.state_dict(keep_vars=True)
    first_rank = model.collectives.rank == 0
    first_replica = model.replica_rank == 0
    for key, value in entries.items():
        p = by_key.get(key)
        layout = layouts.get(id(p)) if p is not None else None
        if layout is not None:  # the layout's shape: a 0-dim parameter's shard is one row
            sharded = layout.world_size > 1
            out[key] = LocalPiece(key, tuple(layout.shape), layout.start, layout.stop, value, sharded,
                                  first_replica if sharded else first_rank)
        else:
            shape = tuple(value.shape)
            out[key] = LocalPiece(key, shape, 0, rows_of(shape), value, False, first_rank)
    return out


def load_local_pieces(model: Any, rows: dict[str, torch.Tensor]) -> None:
    """Copy ``rows[key]`` (this rank's rows of each entry, as ``local_pieces`` describes them) into
    the model, in place. The caller has checked keys and shapes: this only copies."""
    pieces = local_pieces(model)
    with torch.no_grad():
        for key, value in rows.items():
            target = pieces[key].tensor
            target.copy_(value.reshape(target.shape))
    model.shards_changed()
