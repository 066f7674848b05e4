"""ShardedGradScaler: fp16 loss scaling whose inf/nan verdict is the same on every rank."""

from __future__ import annotations

import torch


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` for sharded gradients.

    Each rank only sees its gradient shards, so an overflow on one rank must skip the step on all
    of them: after unscaling, the found-inf flags are combined with one all-reduce (max) over the
    backend's collectives. Construct it with the backend: ``ShardedGradScaler(backend)``.
    """

    def __init__(self, backend, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__(backend.device_type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._collectives = backend.collectives
        self._agree_device = backend.device()

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        flag = torch.zeros((), dtype=torch.float32, device=self._agree_device)
        for t in per_device.values():
            flag = torch.maximum(flag, t.to(self._agree_device, torch.float32).reshape(()))
        self._collectives.all_reduce(flag, op="max")
        for t in per_device.values():
            t.copy_(flag.to(t.device, t.dtype).reshape(t.shape))
        if not per_device:  # this rank holds no gradients: record the verdict on found_inf
            found_inf.copy_(flag.to(found_inf.device, found_inf.dtype).reshape(found_inf.shape))
            per_device[found_inf.device] = found_inf
        return per_device
