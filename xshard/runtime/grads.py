"""Gradient clipping inside an accumulation window, as Accelerate does it.

Accelerate's ``clip_grad_norm_`` / ``clip_grad_value_`` do not wait for the end of the window: called
on a micro-step inside it, they clip the gradients accumulated so far on this process (not yet
reduced over processes) and return their local norm. Scripts that clip on every micro-step get
that result on Accelerate, so xshard does the same. Inside a window the sharded core holds each
unit's full local gradients (its ``no_sync`` mode) rather than the Parameters' ``.grad`` shards;
``held_gradients`` asks the prepared models for them (``ShardedModel.local_gradients``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# the one norm clipping, shared with the sharded model (public here as ``grads.clip_norm_``)
from ..sharding.grad_clip import clip_norm_

__all__ = ["clip_norm_", "clip_value_", "held_gradients"]


def held_gradients(models: list, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients this process holds for ``params`` in an unfinished window (prepared models'
    local full gradients; plain ``.grad`` for parameters of no prepared model)."""
    params = list(params)
    ids = {id(p) for p in params}
    grads: list[torch.Tensor] = []
    covered: set[int] = set()
    for model in models:
        mine = [p for p in model.parameters() if id(p) in ids]
        if not mine:
            continue
        covered.update(id(p) for p in mine)
        grads += model.local_gradients(mine)
    grads += [p.grad for p in params if id(p) not in covered and p.grad is not None]
    return grads


def clip_value_(grads: list[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (exact on shards too)."""
    with torch.no_grad():
        for g in grads:
            g.clamp_(-clip_value, clip_value)
