"""Fake CUDA runtime answers on a CPU-only torch: patch torch.cuda's functions and record calls.

Each stand-in has the real function's name and parameters (tests/test_vendor_conformance.py checks
them against this torch) and the side effects xshard relies on: ``set_device`` and the questions that
read the current device start CUDA there (``calls.runtime_started_on``), and ``is_bf16_supported``
says yes to an emulating GPU unless asked with ``including_emulation=False``, as torch's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch


@dataclass
class CUDACalls:
    """What the backend asked of the fake CUDA runtime."""

    set_device: list[int] = field(default_factory=list)
    #: the GPU CUDA started on (None: not started)
    runtime_started_on: int | None = None
    bf16_questions: list[dict] = field(default_factory=list)


def fake_cuda(
    monkeypatch: pytest.MonkeyPatch, device_count: int = 2, bf16: bool = True, initialized: bool = False,
    built: bool = True, capability: tuple[int, int] | None = None,
) -> CUDACalls:
    """Make this CPU build of torch answer like a CUDA machine with ``device_count`` GPUs.

    ``capability`` is the GPUs' compute capability; by default (8, 0) when ``bf16`` else (7, 0).
    """
    calls = CUDACalls()
    gpus = device_count
    major, _ = capability if capability is not None else ((8, 0) if bf16 else (7, 0))
    state = {"initialized": initialized, "current": 0}

    def start() -> None:
        if not state["initialized"]:
            state["initialized"] = True
            calls.runtime_started_on = state["current"]

    def is_built() -> bool:
        return built

    def device_count() -> int:
        return gpus

    def is_initialized() -> bool:
        return state["initialized"]

    def set_device(device) -> None:
        index = device.index if isinstance(device, torch.device) else int(device)
        calls.set_device.append(index)
        state["current"] = index
        start()

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        start()  # torch asks torch.cuda.current_device(), which starts CUDA there
        calls.bf16_questions.append({"device": state["current"], "including_emulation": including_emulation})
        # sm_80+ computes in bf16; older GPUs emulate it (torch's check creates a bf16 tensor there)
        return major >= 8 or including_emulation

    monkeypatch.setattr(torch.backends.cuda, "is_built", is_built)
    def get_device_name(device=None) -> str:
        return "NVIDIA A100-SXM4-80GB"

    for fn in (device_count, is_initialized, set_device, is_bf16_supported, get_device_name):
        monkeypatch.setattr(torch.cuda, fn.__name__, fn)
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    return calls
