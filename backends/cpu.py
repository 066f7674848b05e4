"""CPU backend: gloo process group, the backend every machine has."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .base import Backend


class CPUBackend(Backend):
    """Plain CPUs over gloo. Always available; the last step of the auto order."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    native_avg = False  # gloo's AVG support varies by version: SUM then divide is always right
    allocator_caches = False  # torch's CPU allocator is malloc (see DeviceAPI.allocator_caches)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no gloo support: install the official torch wheel (pip install torch)"
        return None

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int | None = None) -> None:
        """CPUs need no binding."""

    def synchronize(self) -> None:
        """CPU work is synchronous."""

    def rng_state(self) -> torch.Tensor | None:
        return None  # torch.get_rng_state() (saved by the caller) covers the CPU generator

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Nothing beyond torch's CPU generator."""

    def memory_stats(self) -> dict[str, int]:
        # Host memory is not tracked by an allocator; the sharded core counts its own bytes.
        return {"allocated": 0, "peak": 0}

    def reset_peak_memory_stats(self) -> None:
        """Nothing to reset."""

    def supports(self, dtype: torch.dtype) -> bool:
        # CPU autocast computes in bf16 (and fp16 on recent torch); fp16 matmuls are slow but correct.
        return dtype in (torch.float32, torch.bfloat16, torch.float16)

    def collective_options(self) -> dict[str, Any]:
        # gloo's own reduce_scatter and all_gather are slower than an all_reduce and a broadcast per
        # rank that do the same job (measured: benchmarks/collectives_gloo.py).
        return {"reduce_scatter_via_all_reduce": True, "all_gather_via_broadcast": True}
