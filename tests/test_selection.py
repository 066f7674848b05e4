"""Choosing the backend: XSHARD_BACKEND, backend=, their conflicts, and the auto order
tpu, xla, npu, cuda, mps, cpu (npu before cuda: torch_npu's transfer_to_npu patches torch.cuda)."""

from __future__ import annotations

import os
import sys
import types

import pytest
from support.fakes.cuda import fake_cuda
from support.fakes.mps import fake_mps

from xshard.backends import (
    AUTO_ORDER,
    BackendConflictError,
    BackendUnavailableError,
    UnknownBackendError,
    backend_class,
    select,
)

pytest_plugins = ("support.fakes.fixtures",)  # fixtures: fake_npu, make_fake_npu, no_torch_npu, no_torch_tpu, no_xla


def test_auto_order_is_the_documented_one() -> None:
    assert AUTO_ORDER == ("tpu", "xla", "npu", "cuda", "mps", "cpu")


def test_auto_on_a_plain_machine_picks_cpu_and_says_why_not_the_others(no_xla, no_torch_npu, no_torch_tpu) -> None:
    selection = select()
    assert selection.name == "cpu"
    assert selection.reason == "auto: first available in the order tpu, xla, npu, cuda, mps, cpu"
    skipped = dict(selection.skipped)
    assert list(skipped) == ["tpu", "xla", "npu", "cuda", "mps"]
    assert "torch_tpu is not installed" in skipped["tpu"]
    assert "torch_npu is not installed" in skipped["npu"]
    assert "built without CUDA" in skipped["cuda"]
    assert "built without MPS" in skipped["mps"]


def test_npu_wins_over_cuda(no_xla, fake_npu) -> None:
    fake_cuda(no_xla)  # e.g. transfer_to_npu makes torch.cuda answer too
    selection = select()
    assert selection.name == "npu" and [n for n, _ in selection.skipped] == ["tpu", "xla"]


def test_cuda_wins_over_mps_and_cpu(no_xla, no_torch_npu) -> None:
    fake_cuda(no_xla)
    fake_mps(no_xla)
    assert select().name == "cuda"


def test_transfer_to_npu_never_passes_for_cuda(no_xla, fake_npu) -> None:
    fake_cuda(no_xla)
    no_xla.setitem(sys.modules, "torch_npu.contrib.transfer_to_npu", types.ModuleType("transfer_to_npu"))
    assert select().name == "npu"
    no_xla.setenv("XSHARD_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError, match="redirects torch.cuda to the NPU: use XSHARD_BACKEND=npu"):
        select()


def test_mps_before_cpu(no_xla, no_torch_npu) -> None:
    fake_mps(no_xla)
    assert select().name == "mps"


def test_xla_comes_first(clean_env, fake_npu) -> None:
    clean_env.setattr(backend_class("xla"), "unavailable_reason", classmethod(lambda cls: None))
    assert select().name == "xla"


def test_a_crashing_probe_is_skipped_with_its_reason(no_xla, no_torch_npu) -> None:
    def boom(cls):
        raise RuntimeError("driver exploded")

    no_xla.setattr(backend_class("cuda"), "unavailable_reason", classmethod(boom))
    selection = select()
    assert selection.name == "cpu"
    assert dict(selection.skipped)["cuda"] == "its availability probe failed: RuntimeError: driver exploded"


def test_probing_everything_changes_no_environment(no_xla, fake_npu) -> None:
    before = dict(os.environ)
    for name in AUTO_ORDER:
        backend_class(name).is_available()
    assert dict(os.environ) == before
    assert fake_npu.set_device == []


@pytest.mark.parametrize("value", ["npu", "NPU", " Npu "])
def test_env_var_is_case_insensitive(fake_npu, clean_env, value: str) -> None:
    clean_env.setenv("XSHARD_BACKEND", value)
    selection = select()
    assert selection.name == "npu" and selection.reason == f"XSHARD_BACKEND={value}" and selection.skipped == ()


def test_argument_when_env_is_auto_or_unset(clean_env) -> None:
    assert select("CPU").reason == "backend='CPU' argument"
    clean_env.setenv("XSHARD_BACKEND", "auto")
    assert select("cpu").name == "cpu"


def test_env_and_argument_agreeing_is_fine(clean_env) -> None:
    clean_env.setenv("XSHARD_BACKEND", "CPU")
    assert select("cpu").name == "cpu"


def test_conflict_names_both(clean_env) -> None:
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    with pytest.raises(BackendConflictError) as err:
        select("cuda")
    assert "backend='cuda'" in str(err.value) and "XSHARD_BACKEND='cpu'" in str(err.value)


@pytest.mark.parametrize("via", ["env", "arg"])
def test_unknown_name_lists_the_valid_ones(clean_env, via: str) -> None:
    if via == "env":
        clean_env.setenv("XSHARD_BACKEND", "gpu")
        call, shown = (lambda: select()), "XSHARD_BACKEND='gpu'"
    else:
        call, shown = (lambda: select("ipu")), "backend='ipu'"
    with pytest.raises(UnknownBackendError) as err:
        call()
    assert shown in str(err.value)
    assert "valid values are: auto, tpu, xla, npu, cuda, mps, cpu" in str(err.value)


def test_explicit_backend_never_falls_back(no_torch_npu) -> None:
    no_torch_npu.setenv("XSHARD_BACKEND", "npu")
    with pytest.raises(BackendUnavailableError, match="torch_npu is not installed"):
        select()
