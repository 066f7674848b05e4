"""Guarded imports of vendor modules (torch_npu, torch_xla).

A vendor package can be installed but unusable. torch_npu's real failures are exceptions: an
ImportError when its ``_C`` extension cannot find CANN's ``libhccl.so`` / ``libascendcl.so`` (CANN not
installed, or ``set_env.sh`` not sourced), a RuntimeError when torch is a CUDA build ("Two
accelerators cannot be used at the same time"), or an ImportError for a torch it was not built
for. A probe must survive these and say what happened, so ``import_vendor`` returns the cause as text.

One side effect is undone: ``import torch_npu`` sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` before it
imports anything and restores the user's value only when it finishes, so a failed import would leave
auto-loading switched off for this process and every process it starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"


@dataclass(frozen=True)
class VendorImport:
    """The outcome of importing a vendor module: the module, or why it could not be imported.

    ``missing`` is True when the package is not installed at all (as opposed to installed but
    failing to load), so error messages can say "install it" rather than "fix its setup".
    """

    module: ModuleType | None
    error: str | None = None
    missing: bool = False

    @property
    def ok(self) -> bool:
        return self.module is not None


def import_vendor(name: str) -> VendorImport:
    """Import ``name`` without letting its failure (ImportError, OSError, RuntimeError, ...) escape."""
    if name in sys.modules and sys.modules[name] is not None:
        return VendorImport(sys.modules[name])
    try:
        # find_spec itself can raise for a broken parent package; treat that as "not installed".
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            return VendorImport(None, f"{name} is not installed", missing=True)
    except (ImportError, ValueError):
        return VendorImport(None, f"{name} is not installed", missing=True)
    autoload = os.environ.get(AUTOLOAD_ENV)
    try:
        return VendorImport(importlib.import_module(name))
    except ModuleNotFoundError as exc:
        _restore(AUTOLOAD_ENV, autoload)
        if exc.name == name or name in sys.modules and sys.modules[name] is None:
            return VendorImport(None, f"{name} is not installed", missing=True)
        return VendorImport(None, f"import {name} failed: {type(exc).__name__}: {_first_line(exc)}")
    except Exception as exc:  # ImportError from a C extension, OSError, RuntimeError from an import-time check
        _restore(AUTOLOAD_ENV, autoload)
        return VendorImport(None, f"import {name} failed: {type(exc).__name__}: {_first_line(exc)}")


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def torch_release() -> str:
    """torch's version without the local build tag ("2.13.0+cpu" -> "2.13.0"), for install hints."""
    import torch

    return torch.__version__.split("+")[0]
