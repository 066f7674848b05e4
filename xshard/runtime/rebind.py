"""Optimizers built before ``prepare`` keep training the right Parameters on every backend.

On most devices the sharded core keeps each of the user's ``nn.Parameter`` objects and only changes
its data, so an optimizer built before ``prepare`` is still right. A Parameter whose tensor type
cannot take the device's data in place (a CPU Parameter and an XLA device) is replaced by a new one;
an optimizer holding the old object would then step tensors the model no longer uses, and the run
would learn nothing. So:

- an optimizer passed to ``prepare`` (with its model, before or after it) is rebound: its param
  groups and state point at the replacements, as Accelerate does on TPUs;
- an optimizer that still holds a replaced Parameter when it steps (it was never passed to
  ``prepare``) raises ``StaleParameterError`` naming the fix, through a global step pre-hook that
  exists only while some parameter was replaced.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..errors import XShardError


class StaleParameterError(XShardError, RuntimeError):
    """An optimizer steps Parameters that ``prepare`` replaced (it was not passed to ``prepare``)."""


def rebind_optimizer(optimizer: torch.optim.Optimizer, replaced: dict[int, nn.Parameter]) -> int:
    """Point ``optimizer``'s param groups and state at the replacements; returns how many were rebound."""
    count = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = replaced.get(id(p))
            if new is not None and new is not p:
                if p in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(p)
                params[i] = new
                count += 1
    return count


class StaleParameterGuard:
    """Refuses a step of any optimizer that holds a replaced Parameter (see the module docstring)."""

    def __init__(self) -> None:
        self._old: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
        self._handle: Any = None

    def watch(self, old_params: list[nn.Parameter]) -> None:
        """Start refusing steps over ``old_params`` (the Parameters that were replaced)."""
        for p in old_params:
            self._old[id(p)] = p
        if self._handle is None and len(self._old):
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handle = register_optimizer_step_pre_hook(self._check)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                stale = self._old.get(id(p))
                if stale is not None and stale is p:
                    raise StaleParameterError(
                        f"{type(optimizer).__name__} steps a parameter of shape {tuple(p.shape)} that prepare() "
                        "replaced (its tensors could not move to the device in place), so the model would never "
                        "change. Pass the optimizer to accelerator.prepare(model, optimizer) (before or after "
                        "the model), or build it from the prepared model's parameters()")
