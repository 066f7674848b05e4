"""``import torch`` for the xshard command, with a device extension's failure explained in one line.

torch >= 2.5 imports every installed device extension while it is itself imported (the entry points
of the "torch.backends" group: torch_npu has one), unless TORCH_DEVICE_BACKEND_AUTOLOAD=0. A broken
extension then fails inside ``import torch`` as "RuntimeError: Failed to load the backend extension:
NAME", caused by the extension's own error (torch_npu without CANN: an ImportError naming
libhccl.so; beside a CUDA build of torch: "Two accelerators cannot be used at the same time").
Nothing of xshard can run then, so the command imports torch through here first. This module
imports only the standard library.
"""

from __future__ import annotations

import importlib.metadata
import re
from types import ModuleType

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: torch's message (torch/__init__.py, _import_device_backends), torch 2.5 to 2.13
_AUTOLOAD_FAILED = re.compile(r"Failed to load the backend extension: ([A-Za-z0-9_.\-]+?)\.?(\s|$)")


class TorchImportError(ImportError):
    """``import torch`` failed in an installed device extension; the message says which, why, and the fix."""


_failure: TorchImportError | None = None  # a second `import torch` after a failed one fails differently


def import_torch() -> ModuleType:
    """``import torch``; a failure of an auto-loaded extension becomes a TorchImportError that explains it."""
    global _failure
    if _failure is not None:
        raise _failure
    try:
        import torch
    except RuntimeError as exc:
        found = _AUTOLOAD_FAILED.search(str(exc))
        if found is None:
            raise
        _failure = TorchImportError(explain_autoload_failure(found.group(1), exc.__cause__))
        raise _failure from exc
    return torch


def explain_autoload_failure(extension: str, cause: BaseException | None) -> str:
    """One line: the extension torch auto-loaded, its own error, and how to fix or avoid it."""
    release = _torch_release()
    error = f"{type(cause).__name__}: {_first_line(cause).rstrip('.')}" if cause is not None else "an error"
    if extension != "torch_npu":
        fix = f"repair or uninstall {extension}"
    elif "Two accelerators" in str(cause):
        fix = (f"torch_npu needs the CPU build of torch beside it (pip install torch=={release} --index-url "
               "https://download.pytorch.org/whl/cpu)")
    else:
        fix = ("set up CANN before starting Python (source <CANN install>/set_env.sh) and install the torch-npu "
               f'release matching torch {release} (pip install "torch-npu=={release}.*")')
    return (f"import torch failed: torch auto-loads the installed device extension {extension}, which raised "
            f"{error}. Fix: {fix}; or export {AUTOLOAD_ENV}=0 to import torch without {extension} "
            "(then `xshard env` reports why its backend cannot run)")


def _torch_release() -> str:
    try:
        return importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return "<your torch version>"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
