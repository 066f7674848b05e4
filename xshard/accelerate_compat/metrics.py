"""Evaluation across processes: gather without the repeated samples, pad, gather Python objects, split inputs.

``gather_for_metrics`` gives per-sample values in the loader's order, each sample once:

- a prepared loader gives every rank the same number of samples by repeating a few at the end of an
  epoch, so a plain gather of a 37-sample evaluation set on 2 ranks returns 38 predictions; the
  loader knows how many of each rank's samples in the batch in use are real
  (``ShardedDataLoader.real_counts``), and the repeats are dropped;
- rank ``r`` holds the ``r``-th block of each global batch (Accelerate's layout), so the gathered parts,
  repeats dropped, are in the loader's order: predictions line up with the data set's labels, e.g. in
  the PEFT guide's accuracy loop.

Values with one row per sample of the batch are reordered and cut to the real samples. Any other
gathered tensor whose ranks' parts have equal length (``loss.repeat(batch_size)``, the transformers
examples' evaluation pattern, or a batch's flattened tokens) is cut as Accelerate cuts it: in the
batch that holds repeats, rank ``r``'s part keeps its first ``counts[r]`` rows (``counts[r]``: the
real samples rank ``r`` read), which is what Accelerate's "the first ``remainder`` rows of the
gathered value" keeps.
So a repeated per-rank loss is weighted by the real samples behind it, and evaluation numbers equal
Accelerate's whenever the ranks read the same samples.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch

from ..sharding.trees import map_leaves

__all__ = ["gather_object", "gather_sizes", "in_loader_order", "map_tensors", "only_tensors",
           "pad_across_processes", "split_between_processes"]


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any], strict: bool = True) -> Any:
    """Apply ``fn`` to every tensor in nested dicts/lists/tuples (other leaves: an error, or kept)."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if strict:
            raise TypeError(f"expected tensors (or dicts/lists/tuples of them), got {type(x).__name__}")
        return x

    return map_leaves(data, leaf)


def only_tensors(data: Any) -> bool:
    """True when every leaf of ``data`` is a tensor."""
    try:
        map_tensors(data, lambda t: t)
    except TypeError:
        return False
    return True


def gather_sizes(collectives: Any, device: torch.device, size: int) -> list[int]:
    """Every rank's ``size`` (one small all-gather)."""
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    out = torch.empty(collectives.world_size, dtype=torch.int64, device=device)
    collectives.all_gather_into_tensor(out, mine)
    return [int(v) for v in out.tolist()]


def pad_across_processes(collectives: Any, device: torch.device, data: Any, dim: int = 0, pad_index: int = 0,
                         pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the largest size any rank has, so that it can be gathered."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or dim >= t.dim() or dim < -t.dim():
            return t
        axis = dim % t.dim()
        longest = max(gather_sizes(collectives, device, t.shape[axis]))
        if longest == t.shape[axis]:
            return t
        shape = list(t.shape)
        shape[axis] = longest
        out = t.new_full(shape, pad_index)
        start = longest - t.shape[axis] if pad_first else 0
        out.narrow(axis, start, t.shape[axis]).copy_(t)
        return out

    return map_tensors(data, pad)


def gather_object(collectives: Any, device: torch.device, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; a list from each rank is flattened into one."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = gather_sizes(collectives, device, payload.numel())
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    out = torch.empty(collectives.world_size * longest, dtype=torch.uint8, device=device)
    collectives.all_gather_into_tensor(out, padded)
    raw = out.cpu().numpy().tobytes()
    parts = [pickle.loads(raw[r * longest: r * longest + sizes[r]]) for r in range(len(sizes))]  # noqa: S301
    if all(isinstance(p, list) for p in parts):
        return [item for part in parts for item in part]
    return parts


def in_loader_order(gathered: Any, counts: list[int], batch_len: int, world_size: int,
                    full_batch_len: int | None = None) -> Any:
    """Per-sample rows of a gathered batch (tensors, or a flattened object list) in the loader's order,
    without the repeats: row ``i`` of rank ``r`` is sample ``i`` of the rank's block of the global batch,
    real when ``i < counts[r]``.

    ``batch_len``: samples per rank in the batch. In a batch that holds repeats, a value whose per-rank
    parts have another length keeps each rank's first ``counts[r]`` rows (``loss.repeat(batch_size)``
    in the transformers examples); elsewhere such a value is not per-sample and stays as gathered.
    ``full_batch_len``: the loader's batch size; in a smaller last batch, a value with that many rows
    per rank is read as rows of a full batch, of which the first ``counts[r]`` are real (the transformers
    Trainer gathers each batch's loss repeated batch-size times, and Accelerate keeps the real ones).
    """
    has_repeats = sum(counts) < batch_len * world_size
    smaller_last = full_batch_len is not None and batch_len < full_batch_len

    def order(per_rank: int) -> list[int]:
        return [r * per_rank + i for r in range(world_size) for i in range(min(per_rank, counts[r]))]

    def arrange(rows: Any) -> Any:
        total = len(rows) if not isinstance(rows, torch.Tensor) else (rows.shape[0] if rows.dim() else 0)
        part = total // world_size if total and total % world_size == 0 else 0
        if total == batch_len * world_size:  # one row per sample of this batch
            keep = order(batch_len)
        elif part and (has_repeats or (smaller_last and part == full_batch_len)):
            # Per-rank parts of another length (``loss.repeat(batch_size)``): each rank's first
            # ``counts[r]`` rows are its real samples, as Accelerate keeps the first ``remainder``.
            keep = order(part)
        else:  # not one row per sample of this batch
            return rows
        if isinstance(rows, torch.Tensor):
            return rows[torch.tensor(keep, dtype=torch.long, device=rows.device)]
        return [rows[k] for k in keep]

    if isinstance(gathered, list) and not only_tensors(gathered):
        return arrange(gathered)
    return map_tensors(gathered, arrange, strict=False)


@contextlib.contextmanager
def split_between_processes(inputs: Any, rank: int, world_size: int, apply_padding: bool = False) -> Iterator[Any]:
    """This rank's contiguous share of a list, tuple, tensor or dict of them (earlier ranks get one
    more when it does not divide); ``apply_padding`` repeats the last item so all shares are equal."""

    def share(items: Any) -> Any:
        n = len(items)
        per, extra = divmod(n, world_size)
        start = rank * per + min(rank, extra)
        end = start + per + (1 if rank < extra else 0)
        part = items[start:end]
        if apply_padding:
            want = math.ceil(n / world_size)
            if len(part) < want and n:
                last = items[-1:]
                fill = want - len(part)
                if isinstance(part, torch.Tensor):
                    part = torch.cat([part, last.repeat(fill, *([1] * (last.dim() - 1)))])
                else:
                    part = part + type(part)(list(last) * fill)
        return part

    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError("split_between_processes: every value of the dict must have the same length")
        yield cast(Any, type(inputs))({k: share(v) for k, v in inputs.items()})
    else:
        yield share(inputs)
