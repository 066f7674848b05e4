"""Shard geometry: per-parameter dim-0 shards with padding, packed into one flat buffer per unit.

A parameter of shape ``(d0, *rest)`` is split along dim 0 into ``world_size`` chunks of
``ceil(d0 / world_size)`` rows; the last ranks' chunks may be short or empty, and are padded to the
chunk size so that every rank sends the same number of elements. In flat terms rank ``r`` owns
elements ``[r * seg, (r + 1) * seg)`` of the parameter, where ``seg = rows_per_rank * row_numel``.

A unit's communication buffer is the concatenation of its parameters' padded segments. The
all-gather output is therefore a ``(world_size, shard_numel)`` matrix whose row ``r`` is rank
``r``'s shard of every parameter; parameter ``i`` is the column block ``[offset_i, offset_i + seg_i)``.
Rebuilding a full parameter is one strided copy per parameter (plus one for a padded tail).
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


def pack_rows(flat_full: torch.Tensor, block: torch.Tensor) -> None:
    """Copy a full parameter (flat, ``numel`` elements) into a ``(world_size, seg)`` block, zero-padded."""
    seg = block.shape[1]
    numel = flat_full.numel()
    if seg == 0:
        return
    whole, rem = divmod(numel, seg)
    if whole:
        block[:whole].copy_(flat_full[: whole * seg].view(whole, seg))
    if rem:
        block[whole, :rem].copy_(flat_full[whole * seg:])
        block[whole, rem:].zero_()
        whole += 1
    if whole < block.shape[0]:
        block[whole:].zero_()


def unpack_rows(block: torch.Tensor, flat_full: torch.Tensor) -> None:
    """Inverse of ``pack_rows``: copy the real elements of a ``(world_size, seg)`` block out."""
    seg = block.shape[1]
    numel = flat_full.numel()
    if seg == 0:
        return
    whole, rem = divmod(numel, seg)
    if whole:
        flat_full[: whole * seg].view(whole, seg).copy_(block[:whole])
    if rem:
        flat_full[whole * seg:].copy_(block[whole, :rem])
