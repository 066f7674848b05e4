"""Shard geometry: per-parameter dim-0 shards with padding, packed into one flat buffer per unit.

A parameter of shape ``(d0, *rest)`` is split along dim 0 into ``world_size`` chunks of
``ceil(d0 / world_size)`` rows; the last ranks' chunks may be short or empty, and are padded to the
chunk size so that every rank sends the same number of elements. In flat terms rank ``r`` owns
elements ``[r * seg, (r + 1) * seg)`` of the parameter, where ``seg = rows_per_rank * row_numel``.

The sharded core gathers each parameter straight into a full storage of ``world_size * seg``
elements (the parameter is its first ``numel``), so the padded shards line up with no copy out.
A packed buffer of several parameters (a full state dict's gather, collectives that pack a unit
into one operation) is a ``(world_size, row)`` matrix whose row ``r`` is rank ``r``'s shard of
every parameter; parameter ``i`` is the column block ``[offset_i, offset_i + seg_i)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamGeometry:
    """Where one parameter's shard lives, for a given world size and rank."""

    shape: torch.Size
    numel: int
    seg: int  # padded shard size in elements (identical on every rank)
    local_numel: int  # this rank's real (unpadded) shard size
    local_shape: torch.Size  # this rank's shard shape, (rows, *rest)

    @classmethod
    def of(cls, shape: torch.Size, world_size: int, rank: int) -> ParamGeometry:
        shape = torch.Size(shape)
        numel = math.prod(shape)
        if len(shape) == 0:
            d0, rest = 1, ()
        else:
            d0, rest = shape[0], tuple(shape[1:])
        row = math.prod(rest) if rest else 1
        rows_per_rank = -(-d0 // world_size) if d0 else 0
        start = min(rank * rows_per_rank, d0)
        stop = min(start + rows_per_rank, d0)
        local_shape = torch.Size((stop - start, *rest)) if len(shape) else torch.Size((stop - start,))
        return cls(shape, numel, rows_per_rank * row, (stop - start) * row, local_shape)


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of several segments in one flat buffer row (units of the buffer's element)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    row_numel: int  # elements per rank in the buffer

    @classmethod
    def of(cls, sizes: list[int], align: int = 1) -> FlatLayout:
        offsets, pos = [], 0
        for size in sizes:
            offsets.append(pos)
            pos += -(-size // align) * align
        return cls(tuple(offsets), tuple(sizes), pos)


def unpack_rows(block: torch.Tensor, flat_full: torch.Tensor) -> None:
    """Copy the real elements of a ``(world_size, seg)`` block (rank ``r``'s padded shard in row ``r``) out."""
    seg = block.shape[1]
    numel = flat_full.numel()
    if seg == 0:
        return
    whole, rem = divmod(numel, seg)
    if whole:
        flat_full[: whole * seg].view(whole, seg).copy_(block[:whole])
    if rem:
        flat_full[whole * seg:].copy_(block[whole, :rem])
