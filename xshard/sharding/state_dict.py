"""Full (unsharded) state dicts: gather one unit at a time to CPU; load by keeping this rank's shard.

Keys are exactly those of the user's ``module.state_dict()`` (tied parameters appear under each of
their names, as there), so the result can go straight to ``save_pretrained`` or ``torch.save``.
Parameters are gathered in their own dtype (the fp32 master values, not the compute copies).
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import rows_of, unpack_rows
from .unit import Unit, plan_buffer, segment


def _gather_unit(unit: Unit, keep: bool, mark_step: Any) -> dict[int, torch.Tensor]:
    """id(user Parameter) -> full CPU tensor for every parameter of ``unit`` (empty if not ``keep``).

    ``mark_step`` (the backend's) runs right after the all-gather: on a compiled device each later
    ``.cpu()`` read would otherwise re-run the pending graph, collective included, on this rank
    alone, and the other ranks (which ran it once) would never meet it.
    """
    if not unit.params:
        return {}
    rt = unit.rt
    dtypes = [sp.dtype for sp in unit.params]
    buf_dtype, layout = plan_buffer([sp.layout.seg for sp in unit.params], dtypes)
    send = torch.zeros(layout.row_numel, dtype=buf_dtype, device=rt.device)
    with torch.no_grad():
        for i, sp in enumerate(unit.params):
            segment(send, layout, i, sp.dtype)[: sp.layout.local_numel].copy_(sp.user.detach().reshape(-1))
    recv = torch.empty(layout.row_numel * rt.world_size, dtype=buf_dtype, device=rt.device)
    rt.collectives.all_gather_into_tensor(recv, send)
    mark_step()
    if not keep:
        return {}
    grid = recv.view(rt.world_size, layout.row_numel)
    out = {}
    for i, sp in enumerate(unit.params):
        full = torch.empty(sp.layout.shape, dtype=sp.dtype, device="cpu")
        unpack_rows(segment(grid, layout, i, sp.dtype).cpu(), full.view(-1))
        out[id(sp.user)] = full
    return out


def _param_keys(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(module.named_parameters(remove_duplicate=False))


def full_state_dict(model: Any, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """See ``ShardedModel.full_state_dict``."""
    keep = not rank0_only or model.collectives.rank == 0
    module = model.module
    by_key = _param_keys(module)
    full: dict[int, torch.Tensor] = {}
    if model.units:
        for unit in model.units:  # one unit in flight at a time: peak memory is one unit, not the model
            full.update(_gather_unit(unit, keep, model.backend.mark_step))
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        p = by_key.get(key)
        if p is not None and id(p) in full:
            out[key] = full[id(p)]
        else:
            out[key] = value.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(model: Any, state_dict: dict[str, torch.Tensor]) -> None:
    """See ``ShardedModel.load_full_state_dict``."""
    module = model.module
    expected = set(module.state_dict().keys())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise KeyError(
            f"state dict does not match the model: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )
    by_key = _param_keys(module)
    shard_of = {id(sp.user): sp for unit in model.units for sp in unit.params}
    rank = model.collectives.rank
    buffers = dict(module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for key, value in state_dict.items():
            p = by_key.get(key)
            if p is None:
                if key in buffers:
                    buffers[key].copy_(value)
                continue
            if tuple(value.shape) != tuple(p.shape if id(p) not in shard_of else shard_of[id(p)].layout.shape):
                raise ValueError(f"state dict entry {key!r} has shape {tuple(value.shape)}, the model's "
                                 f"parameter has {tuple(shard_of[id(p)].layout.shape if id(p) in shard_of else p.shape)}")
            sp = shard_of.get(id(p))
            if sp is None:
                p.copy_(value)
                continue
            g = sp.layout
            flat = value.reshape(-1)[rank * g.seg: rank * g.seg + g.local_numel]
            p.copy_(flat.view(g.local_shape))  # in place on the user's Parameter: bumps its version
    for unit in model.units:
        unit.stale = True


# ---------------------------------------------------------------------- local (per-rank) pieces
#
# A "piece" is the dim-0 row range of one state-dict entry that this rank holds. Sharded parameters
# hold rows ``[rank * ceil(d0 / W), ...)`` (layout.py); everything else (buffers, stage-0 and
# unsharded parameters) is replicated, so its piece is every row and only rank 0 needs to write it.
# 0-dim tensors are viewed as one row. Checkpoints store and reassemble these pieces by rows, which
# is what lets a checkpoint written on W ranks load on any other number of ranks.


class LocalPiece:
    """Rows ``[start, stop)`` of state-dict entry ``key`` (full shape ``shape``) held by this rank."""

    __slots__ = ("key", "shape", "start", "stop", "tensor", "sharded")

    def __init__(self, key: str, shape: tuple[int, ...], start: int, stop: int, tensor: torch.Tensor,
                 sharded: bool) -> None:
        self.key, self.shape, self.start, self.stop = key, shape, start, stop
        self.tensor = tensor  # the live tensor (the user's Parameter or buffer), shape (stop - start, *rest)
        self.sharded = sharded


def local_pieces(model: Any) -> dict[str, LocalPiece]:
    """Every key of ``module.state_dict()`` -> the piece this rank holds (tied keys share one tensor)."""
    module = model.module
    shard_of = {id(sp.user): (sp, unit.rt) for unit in model.units for sp in unit.params}
    by_key = _param_keys(module)
    out: dict[str, LocalPiece] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        p = by_key.get(key)
        found = shard_of.get(id(p)) if p is not None else None
        if found is not None:
            sp, rt = found
            shape = tuple(sp.layout.shape)
            start, stop = sp.layout.start, sp.layout.stop
            sharded = rt.world_size > 1
        else:
            shape = tuple(value.shape)
            start, stop, sharded = 0, rows_of(shape), False
        out[key] = LocalPiece(key, shape, start, stop, value, sharded)
    return out


def load_local_pieces(model: Any, rows: dict[str, torch.Tensor]) -> None:
    """Copy ``rows[key]`` (this rank's rows of each entry, as ``local_pieces`` describes them) into
    the model, in place. The caller has checked keys and shapes: this only copies."""
    pieces = local_pieces(model)
    with torch.no_grad():
        for key, value in rows.items():
            target = pieces[key].tensor
            target.copy_(value.reshape(target.shape))
    for unit in model.units:
        unit.stale = True
