"""The one walker over nested data: tensors inside dicts (any Mapping), lists, tuples and named tuples.

The sharded core walks a module's inputs and outputs with it (model-output classes are Mappings),
``xshard.runtime.data`` moves batches with it and ``xshard.metrics`` gathers and pads with it. A container
whose leaves all come back unchanged is returned as it is; otherwise it is rebuilt as its own type
(a Mapping whose type cannot be built from a dict, as a plain dict). Every other object is a leaf.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch


def map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``tree`` with ``fn`` applied to every leaf (anything that is not a container)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        mapped = {k: map_leaves(v, fn) for k, v in tree.items()}
        if all(mapped[k] is v for k, v in tree.items()):
            return tree
        if isinstance(tree, defaultdict):
            return type(tree)(tree.default_factory, mapped)
        try:
            return cast(Any, type(tree))(mapped)  # keeps dict subclasses: HF BatchEncoding, ModelOutput, OrderedDict
        except TypeError:
            return mapped
    if isinstance(tree, (list, tuple)):
        items = [map_leaves(v, fn) for v in tree]
        if all(new is old for new, old in zip(items, tree, strict=True)):
            return tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # named tuple
            return type(tree)(*items)
        return type(tree)(items)  # list, tuple, torch.return_types
    return fn(tree)


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` with ``fn`` applied to every tensor leaf (other leaves kept)."""
    return map_leaves(tree, lambda x: fn(x) if isinstance(x, torch.Tensor) else x)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor leaf of ``tree``, in the order ``map_leaves`` visits them."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in tensors_in(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_in(v)]
    return []


def replace_grad_tensors(tree: Any, fn: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]) -> Any:
    """Pass all grad-requiring tensor leaves through ``fn`` at once (an autograd Function) and put them back."""
    grad_tensors = tuple(t for t in tensors_in(tree) if t.requires_grad)
    if not grad_tensors:
        return tree
    new = list(fn(grad_tensors))
    if len(new) != len(grad_tensors):
        raise RuntimeError(f"replace_grad_tensors: fn returned {len(new)} tensors for {len(grad_tensors)}")
    replacements = iter(new)
    return map_tensors(tree, lambda t: next(replacements) if t.requires_grad else t)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast floating-point tensor leaves to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    return map_tensors(tree, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
