"""Fake CUDA runtime answers on a CPU-only torch: patch torch.cuda's functions and record calls."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch


@dataclass
class CUDACalls:
    """What the backend asked of the fake CUDA runtime."""

    set_device: list[int] = field(default_factory=list)


def fake_cuda(
    monkeypatch: pytest.MonkeyPatch, device_count: int = 2, bf16: bool = True, initialized: bool = False,
    built: bool = True,
) -> CUDACalls:
    """Make this CPU build of torch answer like a CUDA machine with ``device_count`` GPUs."""
    calls = CUDACalls()
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.set_device.append(int(i)))
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    return calls

