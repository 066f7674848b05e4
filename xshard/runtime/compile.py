"""``compile_prepared``: a prepared (sharded) model compiled as Accelerate compiles a prepared model.

Accelerate's ``prepare_model`` ends with ``torch.compile(model, **dynamo_plugin.to_kwargs())`` when the
Accelerator's ``TorchDynamoPlugin`` names a backend (the transformers Trainer's ``--torch_compile`` builds that
plugin). xshard does the same to the sharded model, whose hooks the compiled graphs run through (see
docs/sharded-core.md, "torch.compile").

Design note: the model is compiled in place (``nn.Module.compile``, which is ``torch.compile`` of the module's
call with the same keywords) rather than wrapped in an ``OptimizedModule``, so ``prepare`` still returns the
prepared model itself: every lookup of the job's models (``unwrap_model``, ``get_state_dict``, ``save_state``,
the Trainer's ``model_wrapped``, checkpoints) finds it, and its forward, backward and hooks are the compiled
ones. What differs from Accelerate: ``accelerate.utils.is_compiled_module(model)`` reads False and there is
no ``model._orig_mod``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["compile_prepared"]


def compile_prepared(model: torch.nn.Module, plugin: Any) -> torch.nn.Module:
    """``model`` compiled in place with ``plugin``'s ``torch.compile`` keywords (nothing when it names no
    backend); ``model`` is returned."""
    if plugin is None or not plugin.enabled:
        return model
    if plugin.use_regional_compilation:
        warnings.warn("TorchDynamoPlugin(use_regional_compilation=True): xshard compiles the whole prepared model "
                      "(compile the repeated blocks yourself with block.compile() before prepare for regional "
                      "compilation)", stacklevel=3)
    model.compile(**plugin.to_kwargs())
    return model
