"""Static shapes for devices that compile whole graphs (XLA): token batches padded to a few widths.

On a TPU every new tensor shape is a new compilation of the whole training step; a collator that pads
each batch to its own longest sequence makes one per width, and compiling a 7B model's step for each
width is the whole run. ``PadToMultiple`` wraps a DataLoader's collate function and pads each batch's
sequence dimension up to a multiple of ``multiple`` (64 by default, ``static_shape_multiple`` in the
config), so a run sees at most ``model_max_length / multiple`` widths. The Accelerator installs it on
the data loaders it prepares when the backend compiles graphs (``Backend.compiles_graphs``).

What is padded by default: Hugging Face-style batches, dicts holding ``input_ids`` and
``attention_mask``. Every tensor of the batch whose dim 1 is the sequence width is padded on the
right: ``labels`` with -100 (ignored by the loss), everything else with 0 (``attention_mask`` 0 masks
the new positions, so the token id there does not matter).

Any other batch (a tuple, a list, a dict with other keys): name the tensors to pad, with their pad
values, and use the collate hook as the loader's ``collate_fn``; the Accelerator keeps it as it is::

    pad = PadToMultiple(default_collate, 64, keys={0: 0, 1: -100})  # (tokens, labels) tuples
    loader = DataLoader(data, batch_size=8, collate_fn=pad)

Each named tensor's dim ``dim`` (1 by default) is padded on the right to its next multiple. Batches
that are not padded and change shape from batch to batch get one log line saying how to name them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

#: a child of the "xshard" logger: it follows the per-rank levels ``xshard.runtime.rank_logging`` sets
log = logging.getLogger(__name__)

#: pad values by key; every other padded tensor gets 0
PAD_VALUES = {"labels": -100}


def padded_width(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple``."""
    return -(-width // multiple) * multiple


def pad_batch(batch: Any, multiple: int) -> Any:
    """A token batch with its sequence dimension padded to a multiple of ``multiple`` (see the module docstring)."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "attention_mask" not in batch:
        return batch
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return batch
    width = ids.shape[1]
    target = padded_width(width, multiple)
    if target == width:
        return batch
    padded = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == width:
            value = _pad_dim(value, 1, target, PAD_VALUES.get(key, 0))
        padded[key] = value
    return _same_container(batch, padded)


def pad_named(batch: Any, multiple: int, keys: Mapping[str | int, float], dim: int = 1) -> Any:
    """``batch`` with the tensors named by ``keys`` (dict keys, or positions in a tuple or list) padded
    along ``dim`` to a multiple of ``multiple`` with their pad values; every other entry unchanged."""
    if isinstance(batch, Mapping):
        items = dict(batch)
        names = items.keys()
    elif isinstance(batch, (tuple, list)):
        items = dict(enumerate(batch))
        names = items.keys()
    else:
        raise TypeError(f"static shapes: keys={list(keys)} name tensors of a dict, tuple or list batch, but the "
                        f"collate function returned a {type(batch).__name__}")
    missing = [k for k in keys if k not in names]
    if missing:
        raise KeyError(f"static shapes: the batch has no {missing} (it has {list(names)}): name its tensors by key "
                       "(dict batches) or position (tuple and list batches)")
    for key, value in keys.items():
        tensor = items[key]
        if not isinstance(tensor, torch.Tensor) or tensor.dim() <= dim:
            raise ValueError(f"static shapes: batch[{key!r}] is not a tensor with a dim {dim} to pad "
                             f"({type(tensor).__name__}{'' if not isinstance(tensor, torch.Tensor) else tuple(tensor.shape)})")
        items[key] = _pad_dim(tensor, dim, padded_width(tensor.shape[dim], multiple), value)
    if isinstance(batch, Mapping):
        return _same_container(batch, items)
    values = [items[i] for i in range(len(batch))]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*values)  # a namedtuple
    return type(batch)(values)


def _pad_dim(tensor: torch.Tensor, dim: int, target: int, value: float) -> torch.Tensor:
    """``tensor`` padded on the right along ``dim`` to ``target`` with ``value``."""
    missing = target - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, missing]
    return F.pad(tensor, pad, value=value)


def _same_container(batch: Mapping, values: dict) -> Any:
    try:
        return cast(Any, type(batch))(values)  # keeps dict subclasses such as BatchEncoding
    except TypeError:
        return values


class PadToMultiple:
    """A collate function: the wrapped one's batch, padded to a multiple of ``multiple``.

    ``keys=None``: token batches (dicts with ``input_ids`` and ``attention_mask``) are padded, others
    left alone. ``keys``: the tensors to pad along ``dim``, by dict key or tuple/list position, each
    with its pad value (a list of names pads with 0, ``labels`` with -100). Picklable (DataLoader
    workers); it runs on the host, before any device copy. A loader whose ``collate_fn`` is one of
    these keeps it when prepared.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None, multiple: int,
                 keys: Mapping[str | int, float] | Sequence[str | int] | None = None, dim: int = 1) -> None:
        if multiple < 1:
            raise ValueError(f"static_shape_multiple={multiple}: use a positive width (e.g. 64), or 0 to turn it off")
        if dim < 0:
            raise ValueError(f"dim={dim}: name the padded dimension from the front (1: the sequence of a batch)")
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        self.collate_fn = collate_fn
        self.multiple = int(multiple)
        if keys is not None and not isinstance(keys, Mapping):
            keys = {k: PAD_VALUES.get(k, 0) if isinstance(k, str) else 0 for k in keys}
        self.keys: dict[str | int, float] | None = dict(keys) if keys is not None else None
        self.dim = dim
        self._shapes: set[tuple] = set()  # shapes of the batches it cannot pad, until they vary

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate_fn(samples)
        if self.keys is not None:
            return pad_named(batch, self.multiple, self.keys, self.dim)
        out = pad_batch(batch, self.multiple)
        if out is batch and not _is_token_batch(batch) and len(self._shapes) < 2:
            self._shapes.add(_shapes(batch))
            if len(self._shapes) == 2:
                log.info("static shapes: the batch shapes change from batch to batch, and only dicts with input_ids "
                         "and attention_mask are padded by themselves: name the tensors to pad with "
                         "DataLoader(..., collate_fn=xshard.static_shapes.PadToMultiple(collate_fn, %d, keys=...)) "
                         "(dict keys or tuple positions), or pad to a fixed length in the collate function, to "
                         "avoid a compilation per shape", self.multiple)
        return out


def _is_token_batch(batch: Any) -> bool:
    return isinstance(batch, Mapping) and "input_ids" in batch and "attention_mask" in batch


def _shapes(batch: Any) -> tuple:
    """The shapes of the tensors in ``batch`` (nested containers flattened), as a hashable tuple."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    if isinstance(batch, Mapping):
        return tuple(s for v in batch.values() for s in _shapes(v))
    if isinstance(batch, (list, tuple)):
        return tuple(s for v in batch for s in _shapes(v))
    return ()
