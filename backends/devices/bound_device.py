"""Questions about the device that only its runtime can answer, asked after the process is bound.

``torch.cuda.is_bf16_supported()`` and ``torch.npu.is_bf16_supported()`` answer for the *current*
device and start the vendor runtime to do so (torch_npu's calls ``_lazy_init()``). Asked before the
process is bound to its device, every process of a job would start its runtime on device 0 (a
context and its memory there, and visible-device changes refused from then on). So the device is
bound first, to this process's own device: what ``init_process_group`` does first anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ..base import Backend

T = TypeVar("T")


def ask_bound_device(backend: Backend, question: Callable[[], T]) -> T:
    """``question()``, after binding this process's device if the runtime has not started yet.

    Once the runtime runs, the device is bound (``set_device`` starts it) or someone else started
    it; either way asking cannot start it anywhere new.
    """
    if not type(backend).runtime_initialized():
        backend.set_device()
    return question()
