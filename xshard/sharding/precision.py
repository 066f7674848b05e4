"""Mixed-precision helpers: buffer casting and fp32 norm layers."""

from __future__ import annotations

import torch
from torch import nn

from .trees import cast_floating
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
