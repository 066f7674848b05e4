"""Guarded imports of vendor modules (torch_npu, torch_xla).

A vendor package can be installed but unusable: ``import torch_npu`` without CANN's shared
libraries raises ImportError or OSError about ``libascendcl.so`` / ``libhccl.so``, and some vendor
builds print a message and call ``sys.exit`` instead of raising. A probe must survive all of these
and say what happened, so ``import_vendor`` catches SystemExit too and returns the cause as text.
Nothing else happens here: no device is touched, no variable is set.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType


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
    """Import ``name`` without letting its failure (ImportError, OSError, SystemExit, ...) escape."""
    if name in sys.modules and sys.modules[name] is not None:
        return VendorImport(sys.modules[name])
    try:
        # find_spec itself can raise for a broken parent package; treat that as "not installed".
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            return VendorImport(None, f"{name} is not installed", missing=True)
    except (ImportError, ValueError):
        return VendorImport(None, f"{name} is not installed", missing=True)
    try:
        return VendorImport(importlib.import_module(name))
    except ModuleNotFoundError as exc:
        if exc.name == name or name in sys.modules and sys.modules[name] is None:
            return VendorImport(None, f"{name} is not installed", missing=True)
        return VendorImport(None, f"import {name} failed: {type(exc).__name__}: {exc}")
    except SystemExit as exc:
        # Some vendor builds call sys.exit() when their runtime libraries are missing.
        detail = f" ({exc.code})" if exc.code not in (None, 0, 1) else ""
        return VendorImport(None, f"import {name} called sys.exit{detail}")
    except Exception as exc:  # ImportError, OSError (missing .so), RuntimeError from a driver probe
        return VendorImport(None, f"import {name} failed: {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def torch_release() -> str:
    """torch's version without the local build tag ("2.13.0+cpu" -> "2.13.0"), for install hints."""
    import torch

    return torch.__version__.split("+")[0]
