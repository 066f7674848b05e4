"""A backend added by writing one file against the contract in backends/README.md: "toy".

A device family of its own name that computes on the host CPU and talks over gloo. Everything not
written here (autocast, grad scaler, process group, collectives, launcher, hooks) is the default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xshard.backends import Backend


class ToyBackend(Backend):
    """Host tensors over gloo, selected with XSHARD_BACKEND=toy."""

    name = "toy"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if dist.is_available() and dist.is_gloo_available() else "this torch build has no gloo"

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int | None = None) -> None:
        """One host device: nothing to bind."""

    def synchronize(self) -> None:
        """Host work is synchronous."""

    def rng_state(self) -> torch.Tensor | None:
        return None  # torch's CPU generator is the device generator

    def memory_stats(self) -> dict[str, int]:
        return {"allocated": 0, "peak": 0}

    def reset_peak_memory_stats(self) -> None:
        """No allocator statistics on the host."""
