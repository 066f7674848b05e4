"""MPS backend: one Apple-silicon GPU, in one process.

Facts that shape this class:
- No process-group backend moves MPS tensors (gloo and nccl do not), so a job is one process;
  a larger WORLD_SIZE is refused with the reason. Multi-process runs on a Mac use XSHARD_BACKEND=cpu.
- Ops without an MPS kernel fail unless PYTORCH_ENABLE_MPS_FALLBACK=1 (run them on the CPU). torch
  reads that variable once, when it is imported; so the launcher sets it for the processes it
  starts (``default_env``), and a process that imported torch first is told to export it.
- fp32 and fp16 always; bf16 needs macOS 14 (asked of torch's MPS runtime; torch >= 2.9 has the kernels).
- fp16 loss scaling: ``torch.amp.GradScaler("mps")`` (the default ``grad_scaler``).
"""

from __future__ import annotations

import logging

import torch

from ..base import Backend, World
from ..launchers.single import SingleLauncher

log = logging.getLogger("xshard.backends")

FALLBACK_ENV = "PYTORCH_ENABLE_MPS_FALLBACK"


class MPSBackend(Backend):
    """Apple MPS: a single device and a single process; collectives are local no-ops."""

    name = "mps"
    device_type = "mps"
    dist_backend = None
    visible_devices_env = None
    native_avg = False
    max_world_size = 1
    related_env_vars = (FALLBACK_ENV,)

    def __init__(self, world: World | None = None) -> None:
        super().__init__(world)
        if self.apply_default_env():
            log.warning(
                "%s=1 was set after torch was imported, so it takes effect only in processes started "
                "from here; export it before starting Python (xshard launch does) to get the CPU "
                "fallback for ops MPS lacks",
                FALLBACK_ENV,
            )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.backends.mps.is_built():
            return (
                f"this torch ({torch.__version__}) is built without MPS: MPS needs the macOS build of torch "
                "on Apple silicon (pip install torch on macOS 12.3 or newer)"
            )
        if not torch.backends.mps.is_available():
            return "torch has MPS support but no MPS device is available: it needs Apple silicon and macOS 12.3+"
        return None

    @classmethod
    def default_env(cls) -> dict[str, str]:
        return {FALLBACK_ENV: "1", **super().default_env()}

    def world_size_hint(self) -> str:
        return (
            "no process-group backend can exchange MPS tensors (gloo and nccl do not support them), so "
            "MPS runs as a single process; for a multi-process run on this machine use XSHARD_BACKEND=cpu"
        )

    def launcher(self) -> SingleLauncher:
        """One process (``max_world_size``)."""
        return SingleLauncher(self)

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def device_name(self) -> str:
        """"mps": torch names no Apple GPU model (the throughput report has no peak figure for it)."""
        return "mps"

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("mps")

    def set_device(self, local_rank: int | None = None) -> None:
        """There is one MPS device; nothing to bind."""

    def supports(self, dtype: torch.dtype) -> bool:
        """fp32 and fp16 always; bf16 on macOS 14 and newer (the MPS runtime's own answer)."""
        if dtype == torch.bfloat16:
            return bool(torch.backends.mps.is_macos_or_newer(14, 0))
        return dtype in (torch.float32, torch.float16)

    def memory_stats(self) -> dict[str, int]:
        # MPS reports the bytes allocated now; it keeps no peak, so peak is what we have seen.
        allocated = int(torch.mps.current_allocated_memory())
        self._peak = max(getattr(self, "_peak", 0), allocated)
        return {"allocated": allocated, "peak": self._peak}

    def reset_peak_memory_stats(self) -> None:
        self._peak = 0

