"""ShardedGradScaler: the backend's own fp16 loss scaler, with an inf/nan verdict that every rank shares.

Each rank only sees its gradient shards, so an overflow on one rank must skip the step on all of them.
The scaler is the vendor's (``Backend.grad_scaler``: torch_npu's on NPUs, which knows the chip's
overflow-detection modes; ``torch.amp.GradScaler`` elsewhere); its class is swapped for a subclass that,
after unscaling, combines the found-inf flags with one all-reduce (max) over the backend's collectives.
Swapping rather than constructing keeps the vendor's own ``__init__`` (torch_npu's takes no device
argument) and state. torch_npu's scaler also keeps the verdict in ``_has_overflow`` (read by its
``update``), which is set from the shared verdict too, so no rank grows the scale while another backs off.
"""

from __future__ import annotations

from typing import Any

import torch

_SUBCLASSES: dict[type, type] = {}


class ShardedGradScaler:
    """Mixin over a vendor GradScaler class; build one with ``ShardedGradScaler.for_backend(backend)``."""

    _collectives: Any

    @classmethod
    def for_backend(cls, backend: Any, enabled: bool = True, **settings: Any) -> Any:
        """The backend's scaler (``init_scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval`` as ``torch.amp.GradScaler`` takes them), agreeing across ranks."""
        scaler = backend.grad_scaler(enabled=enabled, **settings)
        base = type(scaler)
        if base not in _SUBCLASSES:
            _SUBCLASSES[base] = type(f"Sharded{base.__name__}", (cls, base), {"__module__": __name__})
        scaler.__class__ = _SUBCLASSES[base]
        scaler._collectives = backend.collectives
        return scaler

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # type: ignore[misc]
        # the verdict travels where the scaler keeps its scale: the loss's device, the compute device
        # (also when the gradients themselves are offloaded to the host)
        device = found_inf.device
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for t in per_device.values():
            flag = torch.maximum(flag, t.to(device, torch.float32).reshape(()))
        if getattr(self, "_has_overflow", False):
            flag.fill_(1.0)
        self._collectives.all_reduce(flag, op="max", tag="fp16 overflow verdict")
        for t in per_device.values():
            t.copy_(flag.to(t.device, t.dtype).reshape(t.shape))
        if not per_device:  # this rank holds no gradients: record the verdict on found_inf
            found_inf.copy_(flag.to(found_inf.device, found_inf.dtype).reshape(found_inf.shape))
            per_device[found_inf.device] = found_inf
        if hasattr(self, "_has_overflow"):
            self._has_overflow = bool(flag.item() > 0)
        return per_device
