"""CPU backend: gloo process group, the backend every machine has."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ..base import Backend


class CPUBackend(Backend):
    """Plain CPUs over gloo. Always available; the last step of the auto order."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    native_avg = False  # gloo's AVG support varies by version: SUM then divide is always right
    allocator_caches = False  # torch's CPU allocator is malloc (see DeviceAPI.allocator_caches)
    trainer_device_count = 0  # transformers' n_gpu on a CPU

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no gloo support: install the official torch wheel (pip install torch)"
        return None

    def device_count(self) -> int:
        return 1

    def device_name(self) -> str:
        """The processor as the platform names it (the CPU's peak FLOPS is measured, not looked up)."""
        import platform

        return platform.processor() or platform.machine() or "cpu"

    def measured_peak_tflops(self, dtype: torch.dtype | None, size: int = 512, seconds: float = 0.2) -> float | None:
        """TFLOPS of square ``size`` matmuls in ``dtype`` over ``seconds``, with torch's threads: what this CPU
        really does (no vendor figure fits a shared or throttled host)."""
        dtype = dtype or torch.float32
        own = torch.Generator().manual_seed(0)  # never the script's random stream (its dropout, its sampling)
        a = torch.randn(size, size, generator=own).to(dtype)
        b = torch.randn(size, size, generator=own).to(dtype)
        a @ b  # warm-up
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        return 2.0 * size ** 3 * count / (time.perf_counter() - start) / 1e12

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

    def free_memory(self) -> int | None:
        """The host's available memory (``MemAvailable`` of /proc/meminfo), or None where it has none."""
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def supports(self, dtype: torch.dtype) -> bool:
        # CPU autocast computes in bf16 (and fp16 on recent torch); fp16 matmuls are slow but correct.
        return dtype in (torch.float32, torch.bfloat16, torch.float16)

    def collective_options(self) -> dict[str, Any]:
        # gloo's own reduce_scatter and all_gather are slower than other ways of doing the same job
        # (benchmarks/collectives_gloo.py, 64 MiB fp32 on 2 cores, ms; benchmarks/RESULTS.md): a
        # reduce-scatter by point-to-point exchange sends half the bytes of an all-reduce and its slice
        # (2 ranks: 30-34 against 57-61, gloo's own 95; 4 ranks: 89-90 against 124-125, gloo's own 196),
        # and an all-gather as one broadcast per rank beats gloo's (35 against 75 on 2 ranks; there each
        # broadcast is posted as a send and a receive: DistCollectives._broadcast_slices).
        return {"reduce_scatter_form": "exchange", "all_gather_via_broadcast": True}
