"""Mixed precision: the forward under autocast with fp32 outputs, buffer casting and fp32 norm layers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .trees import cast_floating, map_tensors
from .wrap import is_norm


def cast_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Move buffers to the compute device; cast floating ones to ``dtype`` (None keeps theirs)."""
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is None:
                continue
            target = dtype if dtype is not None and buf.is_floating_point() else buf.dtype
            sub._buffers[name] = buf.to(device=device, dtype=target)


def install_fp32_norms(module: nn.Module, compute_dtype: torch.dtype) -> list:
    """Norm layers run in fp32: inputs cast up before, outputs cast back to ``compute_dtype`` after.

    Their parameters are gathered in fp32 by the units (see ``Unit``); this only handles activations.
    """
    handles = []
    for sub in module.modules():
        if is_norm(sub):
            handles.append(sub.register_forward_pre_hook(
                lambda m, args, kwargs: (cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)),
                with_kwargs=True))
            handles.append(sub.register_forward_hook(
                lambda m, args, output: cast_floating(output, compute_dtype)))
    return handles


_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ForwardPrecision:
    """The root module's forward runs under the backend's autocast; low-precision outputs are cast.

    Installed on the user's own module (its ``forward`` attribute, as Accelerate does), so whatever
    calls it (``model(...)``, ``generate()``, a loss inside the forward) computes in the compute dtype
    with no user code, and floating outputs come back in ``output_dtype`` (fp32 under the
    Accelerator). ``remove()`` puts the original forward back.
    """

    def __init__(self, module: nn.Module, autocast: Callable[[], Any], output_dtype: torch.dtype | None) -> None:
        self.module = module
        self._had_instance_forward = "forward" in module.__dict__
        self._original = module.forward
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with autocast():
                out = inner(*args, **kwargs)
            return cast_low_precision(out, output_dtype)

        module.forward = forward

    def remove(self) -> None:
        if self._had_instance_forward:
            self.module.forward = self._original
        else:
            self.module.__dict__.pop("forward", None)


def cast_low_precision(tree: Any, dtype: torch.dtype | None) -> Any:
    """fp16/bf16 tensor leaves of ``tree`` cast to ``dtype`` (None: unchanged); other tensors untouched."""
    if dtype is None:
        return tree
    return map_tensors(tree, lambda t: t.to(dtype) if t.dtype in _LOW_PRECISION and t.dtype != dtype else t)
