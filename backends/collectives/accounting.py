"""Byte accounting: ``CommCounter``, the bytes and calls of each collective kind.

Byte accounting follows the ZeRO paper's convention so that counts compare with theory
(ZeRO-3 = 3 psi per step, ZeRO-2 and DDP = 2 psi): an all-gather or a reduce-scatter counts the size
of the full (unsharded) tensor, an all-reduce twice the tensor (it is a reduce-scatter plus an
all-gather), a broadcast the tensor once. These are logical payloads, independent of the wire
algorithm, so the same training step counts the same bytes on every backend.

The list forms (``all_gather_into_tensors`` / ``reduce_scatter_tensors``) gather or reduce several
tensors (one sharded unit's parameters or gradients) as one logical operation: they count one call
and the sum of the tensors' bytes, exactly as one flat operation over a packed buffer would.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class CommCounter:
    """Bytes and calls per collective kind since the last ``reset``."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[kind] += int(nbytes)
            self.calls[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain copy: ``{"bytes": {kind: n}, "calls": {kind: n}}``."""
        with self._lock:
            return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
