"""Activation checkpointing for eager devices (torch.utils.checkpoint, non-reentrant), in place."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_forward(module: torch.nn.Module) -> torch.nn.Module:
    """Make ``module`` recompute its activations in backward instead of keeping them.

    The module's own ``forward`` is wrapped in place, so parameter names and state-dict keys do
    not change (a wrapper module would insert a ``.module.`` level) and module hooks still run once
    per call. Non-reentrant checkpointing: keyword arguments and inputs that do not require grad
    work, and the recompute reads whatever parameters the module holds at that moment (the
    sharded core has gathered them again by then).
    """
    if getattr(module, "_xshard_checkpointed", False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    # torch's stubs type Module.__setattr__ as taking a Tensor or a Module only
    module._xshard_checkpointed = True  # type: ignore[assignment]
    return module
