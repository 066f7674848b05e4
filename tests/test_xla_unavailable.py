"""Without torch_xla, asking for the xla backend fails with what is missing and how to install it."""

from __future__ import annotations

import importlib.util

import pytest

from xshard.backends import BackendUnavailableError, get_backend, select

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed in this environment"
)


def test_xshard_backend_xla_names_torch_xla_and_the_install_command(clean_env) -> None:
    clean_env.setenv("XSHARD_BACKEND", "xla")
    with pytest.raises(BackendUnavailableError) as info:
        get_backend()
    message = str(info.value)
    assert "XSHARD_BACKEND=xla" in message
    assert "torch_xla is not installed" in message
    assert "pip install" in message and "torch-xla" in message


def test_auto_skips_xla_and_says_why(clean_env) -> None:
    selection = select()
    assert selection.name != "xla"
    reasons = dict(selection.skipped)
    assert "torch_xla is not installed" in reasons["xla"]
