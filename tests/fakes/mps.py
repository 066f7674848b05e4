"""Fake MPS answers on a non-Mac torch: patch torch.backends.mps and the macOS version probe."""

from __future__ import annotations

import pytest
import torch


def fake_mps(monkeypatch: pytest.MonkeyPatch, macos: str = "14.5", available: bool = True) -> None:
    """Make this torch answer like a Mac with an MPS device on macOS ``macos``."""
    from xshard.backends import mps

    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: available)
    monkeypatch.setattr(mps.platform, "mac_ver", lambda: (macos, ("", "", ""), "arm64"))
