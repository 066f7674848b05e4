"""pytest fixtures over the fakes: import them into a test module to use them.

    from support.fakes.fixtures import fake_npu, no_xla  # noqa: F401
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from .npu import NPUCalls, install_fake_torch_npu, uninstall_fake_torch_npu
from .tpu import TPUCalls, install_fake_torch_tpu, uninstall_fake_torch_tpu


@pytest.fixture
def make_fake_npu(clean_env) -> Callable[..., NPUCalls]:
    """``make_fake_npu(device_count=.., bf16=.., inf_nan_mode=.., ...)`` installs a fake torch_npu for this test only."""
    saved = sys.modules.get("torch_npu")
    yield install_fake_torch_npu
    uninstall_fake_torch_npu()
    if saved is not None:
        sys.modules["torch_npu"] = saved


@pytest.fixture
def fake_npu(make_fake_npu) -> NPUCalls:
    """A machine with 8 NPUs (bf16-capable): fake torch_npu imported, "hccl" over gloo registered."""
    return make_fake_npu()


@pytest.fixture
def no_torch_npu(clean_env):
    """Make sure torch_npu cannot be imported, whatever is installed."""
    clean_env.setitem(sys.modules, "torch_npu", None)
    return clean_env


@pytest.fixture
def make_fake_tpu(clean_env) -> Callable[..., TPUCalls]:
    """``make_fake_tpu(chips=.., index=.., autoload=..)`` installs a fake torch_tpu for this test only
    (never naming the device type "tpu": that is permanent, so only spawned workers do it)."""
    yield install_fake_torch_tpu
    uninstall_fake_torch_tpu()


@pytest.fixture
def no_torch_tpu(clean_env):
    """Make sure torch_tpu cannot be imported, whatever is installed."""
    clean_env.setitem(sys.modules, "torch_tpu", None)
    return clean_env


@pytest.fixture
def no_xla(clean_env):
    """Take xla out of auto selection, so the tests below it see the same machine in every venv
    (the XLA test environment has a working torch_xla)."""
    from xshard.backends import backend_class

    clean_env.setattr(backend_class("xla"), "unavailable_reason",
                      classmethod(lambda cls: "torch_xla is taken out by the test"))
    return clean_env
