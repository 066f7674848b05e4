"""Gradient clipping by the norm of gradient tensors: local, or over all ranks' gradient shards.

One implementation serves both callers: the sharded model (``ShardedModel.clip_grad_norm_``, the
global norm after the reduce) and ``xshard.runtime.grads`` (inside an accumulation window, this process's
gradients accumulated so far and their local norm, as Accelerate does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..backends import Collectives


def clip_norm_(
    grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, *, device: torch.device | None = None,
    collectives: Collectives | None = None,
) -> torch.Tensor:
    """Scale ``grads`` in place so their ``norm_type`` norm is at most ``max_norm``; return the norm.

    With ``collectives``, each rank holds a disjoint shard of every gradient: the local sum of
    ``|g|^p`` (or the local max for the inf-norm) is combined with one all-reduce, so every rank must
    call it, even one holding no gradient. Without, the norm is this process's own. Same formula as
    ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``, capped at 1).
    ``device``: where the norm lives (default: the first gradient's device, else the CPU).
    """
    norm_type = float(norm_type)
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().to(device, torch.float32))
        if collectives is not None:
            collectives.all_reduce(local, op="max")
        total = local
    else:
        for g in grads:
            local = local + torch.linalg.vector_norm(g.detach().float(), norm_type).to(device) ** norm_type
        if collectives is not None:
            collectives.all_reduce(local, op="sum")
        total = local ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, norm_type: float, collectives: Collectives, device: torch.device,
    sharded: bool,
) -> torch.Tensor:
    """Scale the gradients of ``params`` so their global ``norm_type`` norm is at most ``max_norm``.

    ``sharded``: each rank holds a disjoint shard of every gradient (the norm is all-reduced over
    ``collectives``); otherwise the gradients are replicated and the local norm is the global one.
    """
    grads = [p.grad for p in dict.fromkeys(params) if p.grad is not None]
    return clip_norm_(grads, max_norm, norm_type, device=device, collectives=collectives if sharded else None)
