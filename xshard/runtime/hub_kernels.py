"""Transformers' hub kernels on a device the ``kernels`` library refuses.

From transformers 5.25 ``from_pretrained`` kernelizes the model it loads (``use_kernels`` on by default when the
``kernels`` package is installed, which 5.25 requires) and every ``model.train()`` / ``model.eval()`` kernelizes
it again for the new mode, on the device its parameters are on. The ``kernels`` library refuses device types it
does not know (``ValueError: Unsupported device type 'xla'``): on torch_xla the first ``model.train()`` after
the model moved to the device (the Trainer's, or a script's) would fail. Where the backend says its device runs
no hub kernels (``Backend.runs_hub_kernels``), ``prepare`` turns them off with transformers' own switch
(``model.use_kernels = False``), which puts back the torch forwards, the ones a model without ``kernels`` runs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .rank_logging import get_logger

_log = get_logger("xshard.hub_kernels")

#: the device type the reset kernelizes for; its torch forwards are the same code on every device
_RESET_DEVICE = "cpu"


def turn_off_hub_kernels(model: nn.Module, device_type: str) -> bool:
    """Turn transformers' hub kernels off for every kernelized model inside ``model``; True if any was on.

    The reset kernelizes with an empty kernel mapping for the model's device, which is the refused one once
    the model moved there (a script's ``model.to(device)`` before ``prepare``): it is asked for the CPU instead
    (transformers reads the device to kernelize for from ``_kernels_device`` first), whose forwards are the
    torch ones everywhere, then the model's own setting is put back.
    """
    # transformers' PreTrainedModel members, which nn.Module's type does not declare
    kernelized: list[Any] = [m for m in model.modules() if getattr(m, "use_kernels", False) is True]
    for m in kernelized:
        had = "_kernels_device" in m.__dict__
        before = m.__dict__.get("_kernels_device")
        m._kernels_device = _RESET_DEVICE
        try:
            m.use_kernels = False
        finally:
            if had:
                m._kernels_device = before
            else:
                del m._kernels_device
    if kernelized:
        _log.info("transformers' hub kernels turned off for the model: the kernels library does not run on the "
                 "device type %r (it would refuse it at model.train()); the model runs its torch forwards",
                 device_type)
    return bool(kernelized)
