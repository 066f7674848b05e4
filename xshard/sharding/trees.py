"""Walk the tensors inside a module's inputs and outputs (tuples, lists, dicts, model-output classes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with ``fn`` applied to every tensor leaf."""
    leaves, spec = pytree.tree_flatten(tree)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        return tree
    return pytree.tree_unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor leaf of ``tree``."""
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def replace_grad_tensors(tree: Any, fn: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]) -> Any:
    """Pass all grad-requiring tensor leaves through ``fn`` at once (an autograd Function) and put them back."""
    leaves, spec = pytree.tree_flatten(tree)
    index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not index:
        return tree
    new = fn(tuple(leaves[i] for i in index))
    for i, t in zip(index, new, strict=True):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast floating-point tensor leaves to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    return map_tensors(tree, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
