"""Count the device reads xshard's own code makes: the calls that make a GPU's or an NPU's host wait.

On a GPU or an NPU, reading a device value (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()`` ...)
waits until the device has drained its queue. On the CPU every tensor is on the host, so what is
counted is the calls themselves, made directly by a frame of xshard's package or of ``backends/``
(``sys._getframe``): a read torch's own code makes (its GradScaler's, its optimizers') is not
xshard's to avoid. ``.to`` counts where it copies a tensor off a device to the CPU (so never on the CPU
backend, whose tensors are all on the host: there ``.cpu()`` and the other forms above are counted).

    with HostReads() as reads:
        train_step()
    reads.total, reads.where   # how many, and "item at xshard/x.py:12" for each
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

import xshard

#: the tensor methods that read a device value on the host
READS = ("item", "tolist", "cpu", "__bool__", "nonzero", "__float__", "__int__", "numpy", "to")
_PACKAGE = Path(xshard.__file__).resolve().parent
#: xshard's code: its package, and backends/ (xshard/backends is a link to it)
ROOTS = (str(_PACKAGE) + os.sep, str((_PACKAGE / "backends").resolve()) + os.sep)


def _to_host(tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Does a ``Tensor.to(...)`` call copy ``tensor`` from a device to the CPU?"""
    if tensor.device.type == "cpu":
        return False
    targets = [kwargs.get("device"), *args[:1]]
    for t in targets:
        if isinstance(t, str) and t.split(":")[0] == "cpu":
            return True
        if isinstance(t, torch.device) and t.type == "cpu":
            return True
    return False


class HostReads:
    """While entered, counts the calls of ``READS`` made directly by xshard's code (``total``, ``where``)."""

    def __init__(self) -> None:
        self.where: Counter[str] = Counter()
        self._saved: dict[str, Callable[..., Any]] = {}
        self.counting = True

    @property
    def total(self) -> int:
        """How many reads were counted."""
        return sum(self.where.values())

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.counting and (name != "to" or _to_host(tensor, args, kwargs)):
                caller = sys._getframe(1).f_code.co_filename
                path = os.path.realpath(caller)
                if path.startswith(ROOTS):
                    line = sys._getframe(1).f_lineno
                    self.where[f"{name} at {os.path.relpath(path, _PACKAGE.parent)}:{line}"] += 1
            return real(tensor, *args, **kwargs)

        return counted

    def __enter__(self) -> HostReads:
        for name in READS:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real
            setattr(torch.Tensor, name, self._wrap(name, real))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        self._saved.clear()
