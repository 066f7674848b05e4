"""Fake MPS answers on a non-Mac torch: patch torch.backends.mps with stand-ins of the same names and
parameters (checked against this torch by tests/test_vendor_conformance.py)."""

from __future__ import annotations

import pytest
import torch


def fake_mps(monkeypatch: pytest.MonkeyPatch, macos: str = "14.5", available: bool = True) -> None:
    """Make this torch answer like a Mac with an MPS device on macOS ``macos`` ("" : unknown)."""
    parts = [int(p) for p in macos.split(".")] if macos else [0]
    version = (parts + [0])[:2]

    def is_built() -> bool:
        return True

    def is_available() -> bool:
        return available

    def is_macos_or_newer(major: int, minor: int) -> bool:
        return version >= [major, minor]

    for fn in (is_built, is_available, is_macos_or_newer):
        monkeypatch.setattr(torch.backends.mps, fn.__name__, fn)
