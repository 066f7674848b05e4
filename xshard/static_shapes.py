"""Static shapes for devices that compile whole graphs (XLA): token batches padded to a few widths.

On a TPU every new tensor shape is a new compilation of the whole training step; a collator that pads
each batch to its own longest sequence makes one per width, and compiling a 7B model's step for each
width is the whole run. ``PadToMultiple`` wraps a DataLoader's collate function and pads each batch's
sequence dimension up to a multiple of ``multiple`` (64 by default, ``static_shape_multiple`` in the
config), so a run sees at most ``model_max_length / multiple`` widths. The Accelerator installs it on
the data loaders it prepares when the backend compiles graphs (``Backend.compiles_graphs``).

What is padded: Hugging Face-style batches, dicts holding ``input_ids`` and ``attention_mask``. Every
tensor of the batch whose dim 1 is the sequence width is padded on the right: ``labels`` with -100
(ignored by the loss), everything else with 0 (``attention_mask`` 0 masks the new positions, so the
token id there does not matter). Other batches are left alone; if their shapes change from batch to
batch, one log line says how to keep them static.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .log import get_logger

log = get_logger("xshard.static_shapes")

#: pad values by key; every other padded tensor gets 0
PAD_VALUES = {"labels": -100}


def padded_width(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple``."""
    return -(-width // multiple) * multiple


def pad_batch(batch: Any, multiple: int) -> Any:
    """``batch`` with its sequence dimension padded to a multiple of ``multiple`` (see the module docstring)."""
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
            pad = [0, 0] * (value.dim() - 2) + [0, target - width]
            value = F.pad(value, pad, value=PAD_VALUES.get(key, 0))
        padded[key] = value
    try:
        return type(batch)(padded)  # keeps dict subclasses such as BatchEncoding
    except TypeError:
        return padded


class PadToMultiple:
    """A collate function: the wrapped one's batch, its sequences padded to a multiple of ``multiple``.

    Picklable (DataLoader workers), and it runs in the workers, on the host, before any device copy.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], multiple: int) -> None:
        if multiple < 1:
            raise ValueError(f"static_shape_multiple={multiple}: use a positive width (e.g. 64), or 0 to turn it off")
        self.collate_fn = collate_fn
        self.multiple = int(multiple)
        self._shapes: set[tuple] = set()  # shapes of the batches it cannot pad, until they vary

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate_fn(samples)
        out = pad_batch(batch, self.multiple)
        if out is batch and not _is_token_batch(batch) and len(self._shapes) < 2:
            self._shapes.add(_shapes(batch))
            if len(self._shapes) == 2:
                log.info("static shapes: the batch shapes change from batch to batch, and batches that are not "
                         "dicts with input_ids and attention_mask are not padded: keep their shapes fixed (e.g. "
                         "pad to a fixed length in the collate function) to avoid a compilation per shape")
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
