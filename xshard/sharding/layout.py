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

``ShardedParamView`` pairs a parameter with its names and layout: what the core's siblings (state
dicts, checkpoints, materialization) may know of it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn


def rows_of(shape: tuple[int, ...] | torch.Size) -> int:
    """Number of dim-0 rows of a tensor of ``shape`` (a 0-dim tensor is one row)."""
    return int(shape[0]) if len(shape) else 1


@dataclass(frozen=True)
class ShardLayout:
    """Which dim-0 rows of a tensor of ``shape`` rank ``rank`` of ``world_size`` holds, and its padding.

    The one definition of the core's shard geometry: units, state dicts, materialization, checkpoint
    formats and consolidation all ask this object, so a checkpoint's row tables and the live shards
    can never disagree. Rank ``r`` holds rows ``[start, stop)`` (``ceil(rows / world_size)`` rows
    per rank; the last ranks' ranges may be short or empty) and, in flat terms, elements
    ``[r * seg, r * seg + local_numel)`` of the tensor, padded to ``seg`` elements.

    The derived sizes are computed once per layout (``cached_property``: the fields are frozen, so a
    cached value can never go stale); the core asks them for every parameter at every gather and reduce.
    """

    shape: torch.Size
    world_size: int
    rank: int
    rows_per_rank: int
    row_numel: int
    start: int  # first row this rank holds
    stop: int  # one past the last row this rank holds

    @classmethod
    def of(cls, shape: tuple[int, ...] | torch.Size, world_size: int, rank: int) -> ShardLayout:
        shape = torch.Size(shape)
        rows = rows_of(shape)
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        rows_per_rank = -(-rows // world_size) if rows else 0
        start = min(rank * rows_per_rank, rows)
        return cls(shape, world_size, rank, rows_per_rank, row_numel, start, min(start + rows_per_rank, rows))

    @functools.cached_property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.shape)

    @functools.cached_property
    def seg(self) -> int:
        """Padded shard size in elements (the same on every rank)."""
        return self.rows_per_rank * self.row_numel

    @functools.cached_property
    def local_numel(self) -> int:
        """Real (unpadded) elements this rank holds."""
        return (self.stop - self.start) * self.row_numel

    @functools.cached_property
    def local_shape(self) -> torch.Size:
        """Shape of this rank's shard: ``(rows held, *shape[1:])`` (a 0-dim tensor: ``(rows held,)``)."""
        return torch.Size((self.stop - self.start, *self.shape[1:]))

    @functools.cached_property
    def gather_numel(self) -> int:
        """Elements of an all-gather of every rank's padded shard (>= numel)."""
        return self.world_size * self.seg

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole tensor ``full``, shaped ``local_shape`` (a view where possible)."""
        start = self.start * self.row_numel
        return full.reshape(-1)[start:start + self.local_numel].view(self.local_shape)


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


@dataclass(frozen=True)
class ShardedParamView:
    """What the core's siblings (state dicts, checkpoints, materialization) may know of a parameter:
    the user's Parameter (it holds this rank's rows), its names, and its shard layout."""

    names: tuple[str, ...]
    param: nn.Parameter
    layout: ShardLayout
