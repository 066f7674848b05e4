"""Model-state accounting: bytes of parameters, gradients and optimizer state held by this rank.

Bytes are classified as ``device`` or ``offloaded``. A tensor on a different device type than the
compute device is offloaded; when the compute device is itself the host (CPU backend: offloaded
shards then sit on the compute device's type) nothing can be told apart by location, so the offload
policy decides: master shards, gradient shards and
optimizer state count as offloaded when ``offload_params``/``offload_optimizer`` is on. Full
compute copies of parameters and full gradients always count as device bytes.
"""

from __future__ import annotations

from typing import Any

import torch


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def state_bytes(model: Any) -> dict[str, int]:
    """``{"params", "unsharded_params", "pooled", "grads", "optimizer", "device", "offloaded", "total"}`` in bytes.

    ``params``: what this rank keeps of the parameters (padded shards; the full tensors at stage 0).
    ``unsharded_params``: full compute copies allocated right now (stages 1-3), and the post-forward
    pieces held between a forward and its backward (``reshard_after_forward=k``).
    ``pooled``: memory of freed full parameters kept for the next gather (CPU, layers of 32 MiB and
    more: ``storage_pool``); device bytes.
    ``grads``: gradient shards in ``param.grad`` plus full gradients not yet reduced.
    ``optimizer``: tensors in the state of optimizers passed to ``register_optimizer``.
    """
    rt = model._rt
    offload = bool(rt.plan.offload)
    out = {"params": 0, "unsharded_params": 0, "pooled": 0, "grads": 0, "optimizer": 0, "device": 0, "offloaded": 0}

    def add(kind: str, t: torch.Tensor | None, by_policy_offloaded: bool, nbytes: int | None = None) -> None:
        n = _nbytes(t) if nbytes is None else nbytes
        if n == 0:
            return
        out[kind] += n
        if t is not None and t.device.type != rt.device.type:
            where = "offloaded"
        else:  # where the compute device is the host itself, location tells nothing: the policy does
            host_is_device = rt.shard_device.type == rt.device.type
            where = "offloaded" if by_policy_offloaded and host_is_device else "device"
        out[where] += n

    if model.units:
        for unit in model.units:
            for sp in unit.params:
                add("params", sp.padded, offload)
                add("unsharded_params", sp.full, False, unit.live_full_bytes(sp))
                add("unsharded_params", sp.post_forward, False)
                add("grads", sp.user.grad, offload)
                add("grads", sp.full.grad, False)
    else:
        for p in dict.fromkeys(model.module.parameters()):
            add("params", p, False)
            add("grads", p.grad, False)
    for opt in model._optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    add("optimizer", v, offload)
    if rt.pool is not None:
        out["pooled"] = rt.pool.bytes_held
        out["device"] += rt.pool.bytes_held
    out["total"] = out["params"] + out["unsharded_params"] + out["pooled"] + out["grads"] + out["optimizer"]
    return out
