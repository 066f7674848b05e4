"""MPS backend, emulated: torch.backends.mps and the macOS version are patched on this Linux torch.
Proves the single-process rules and precision choices, not that Metal works (`xshard env --check`)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from support.fakes.mps import fake_mps

from xshard.backends import (
    BackendUnavailableError,
    SingleProcessCollectives,
    World,
    WorldSizeError,
    backend_class,
    select,
)

MPS = backend_class("mps")


def test_unavailable_here_says_why(clean_env) -> None:
    assert "built without MPS" in MPS.unavailable_reason()
    with pytest.raises(BackendUnavailableError, match="backend='mps' argument .* needs the macOS build"):
        select("mps")
    fake_mps(clean_env, available=False)
    assert "needs Apple silicon and macOS 12.3+" in MPS.unavailable_reason()


def test_world_size_two_is_refused_with_the_reason(clean_env) -> None:
    fake_mps(clean_env)
    backend = MPS(World(rank=0, world_size=2, local_rank=0, local_world_size=2))
    with pytest.raises(WorldSizeError) as err:
        backend.init_process_group()
    message = str(err.value)
    assert "WORLD_SIZE=2" in message and "at most 1" in message
    assert "gloo and nccl" in message and "XSHARD_BACKEND=cpu" in message


def test_one_process_needs_no_process_group(clean_env) -> None:
    fake_mps(clean_env)
    backend = MPS(World())
    backend.init_process_group()
    assert isinstance(backend.collectives, SingleProcessCollectives)
    assert backend.device() == torch.device("mps") and backend.launcher().name == "single"
    assert backend.dist_backend is None


def test_fallback_variable_set_only_when_unset_and_logged(clean_env, caplog) -> None:
    fake_mps(clean_env)
    with caplog.at_level(logging.INFO, logger="xshard.backends"):
        MPS(World())
    assert os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] == "1"
    assert "set PYTORCH_ENABLE_MPS_FALLBACK=1" in caplog.text
    assert "export it before starting Python" in caplog.text  # torch read it at import

    caplog.clear()
    clean_env.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "0")
    with caplog.at_level(logging.INFO, logger="xshard.backends"):
        MPS(World())
    assert os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] == "0"  # the user's choice stands
    assert "PYTORCH_ENABLE_MPS_FALLBACK" not in caplog.text


def test_launcher_gets_the_fallback_for_child_processes(clean_env) -> None:
    child_env = {"PYTORCH_ENABLE_MPS_FALLBACK": "0"}
    assert MPS.apply_default_env(child_env) == {}
    child_env = {}
    assert MPS.apply_default_env(child_env) == {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}


@pytest.mark.parametrize("macos,bf16", [("13.6", False), ("14.0", True), ("15.1", True), ("", False)])
def test_precision(clean_env, macos: str, bf16: bool) -> None:
    fake_mps(clean_env, macos=macos)  # the MPS runtime's own torch.backends.mps.is_macos_or_newer answers
    backend = MPS(World())
    assert backend.supports(torch.float32) and backend.supports(torch.float16)
    assert backend.supports(torch.bfloat16) is bf16
    assert not backend.supports(torch.float64)


def test_grad_scaler_is_torch_s_mps_scaler(clean_env) -> None:
    fake_mps(clean_env)
    scaler = MPS(World()).grad_scaler()
    assert type(scaler) is torch.amp.GradScaler and scaler._device == "mps"
    assert scaler.is_enabled()


def test_autocast_asks_for_mps(clean_env) -> None:
    fake_mps(clean_env)
    asked = []
    clean_env.setattr(torch, "autocast", lambda **kw: asked.append(kw))
    MPS(World()).autocast(torch.float16)
    assert asked == [{"device_type": "mps", "dtype": torch.float16}]
