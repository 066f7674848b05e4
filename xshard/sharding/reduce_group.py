"""One reduce's parameters: the group of a unit's trainable parameters reduced in one dtype, in one collective.

Its own module because both the unit (which caches its groups) and the reduce pipeline (which builds and runs
them) name it, and neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .params import ShardedParam


@dataclass(frozen=True)
class ReduceGroup:
    """Trainable parameters of one unit whose gradients are reduced in one dtype, in one collective."""

    dtype: torch.dtype
    params: list[ShardedParam]
    #: each parameter's full-gradient elements (the reduce's input sizes)
    numels: list[int]
    #: elements of each reduced shard, then of the flags (the views of the output buffer)
    sizes: list[int]
    total: int  # sum of ``sizes``
