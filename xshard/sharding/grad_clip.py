"""Gradient clipping over the global norm of all ranks' gradient shards."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, norm_type: float, collectives, device: torch.device,
    sharded: bool,
) -> torch.Tensor:
    """Scale gradients so their global ``norm_type`` norm is at most ``max_norm``; return the norm.

    ``sharded``: each rank holds a disjoint shard of every gradient, so the local sum of
    ``|g|^p`` (or the local max for the inf-norm) is combined with one all-reduce; otherwise the
    gradients are replicated and the local norm is the global one. Same formula as
    ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``, capped at 1).
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in dict.fromkeys(params) if p.grad is not None]
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().to(device, torch.float32))
        if sharded:
            collectives.all_reduce(local, op="max")
        total = local
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local = local + torch.linalg.vector_norm(g.detach().float(), norm_type).to(device) ** norm_type
        if sharded:
            collectives.all_reduce(local, op="sum")
        total = local ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total
