"""Shared test setup: tests run from the repository root, on CPU, with small thread counts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/distributed.py and helpers

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def clean_env(monkeypatch):
    """Remove every variable that selects a backend or a device, so a test starts from nothing."""
    for name in list(os.environ):
        if name.startswith("XSHARD_") or name.endswith("_VISIBLE_DEVICES") or name in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PJRT_DEVICE", "PYTORCH_ENABLE_MPS_FALLBACK",
        ):
            monkeypatch.delenv(name, raising=False)
    return monkeypatch
