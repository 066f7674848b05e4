"""Sharding a stream (an ``IterableDataset``) over ranks, so that no sample is read for training twice.

- A ``datasets.IterableDataset`` with at least one shard per rank is split by node as Accelerate splits it
  (``dataset.shard(num_shards=W, index=rank)``: contiguous blocks of its shards): each rank reads only its own
  files. Its ranks may end
  at different steps, so the prepared loader goes on while any rank has a batch, a rank whose part ended
  reading its first batch again (``ShardedDataLoader._next`` asks ``LoaderAgreement.every_process_count``; ``gather_for_metrics`` drops
  those repeats): no rank waits alone in a collective, and every sample is read.
- Any other stream is read by every rank and cut into windows of one global batch (``batch_size`` times
  the world size, or ``batch_size`` with ``split_batches``): rank ``r`` keeps the ``r``-th slice of each
  window (``StreamShard``), as Accelerate's ``IterableDatasetShard`` does. The last, short window is
  completed with samples from the first window (``drop_last=False``), so every rank reads the same
  number of batches, or dropped (``drop_last=True``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset


class StreamShard(IterableDataset):
    """Rank ``rank``'s slice of every window of ``window`` samples of ``dataset`` (see the module docstring).

    ``per_rank``: samples per rank in a window. ``start``: windows to skip (a resume: they are read and
    dropped, unless the dataset resumed itself from its own ``state_dict``).
    """

    def __init__(self, dataset: Any, per_rank: int, num_replicas: int, rank: int, drop_last: bool) -> None:
        self.dataset = dataset
        self.per_rank = per_rank
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Epoch ``epoch``: passed on to the dataset's own ``set_epoch``."""
        self.epoch = int(epoch)
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)

    def __len__(self) -> int:
        """Samples this rank reads per pass (a ``TypeError`` where the stream has no length)."""
        window = self.per_rank * self.num_replicas
        windows = len(self.dataset) // window if self.drop_last else math.ceil(len(self.dataset) / window)
        return windows * self.per_rank

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)  # a stream shuffled by its own generator: one order per epoch
        window = self.per_rank * self.num_replicas
        mine = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        first: list[Any] | None = None
        current: list[Any] = []
        k = 0
        for sample in self.dataset:
            current.append(sample)
            if len(current) == window:
                if k >= self.start:
                    yield from current[mine]
                first = current if first is None else first
                current, k = [], k + 1
        if current and not self.drop_last and k >= self.start:
            first = list(current) if first is None else first
            while len(current) < window:
                current = current + first
            yield from current[mine]


def splits_by_node(dataset: Any, num_replicas: int) -> bool:
    """True for a ``datasets.IterableDataset`` with at least ``num_replicas`` shards."""
    try:  # an optional dependency (untyped): looked up at run time
        hf_iterable = importlib.import_module("datasets").IterableDataset
    except ImportError:
        return False
    return isinstance(dataset, hf_iterable) and dataset.n_shards >= num_replicas


def split_by_node(dataset: Any, rank: int, num_replicas: int) -> Any:
    """This rank's contiguous block of the shards of a ``datasets.IterableDataset``."""
    return dataset.shard(num_shards=num_replicas, index=rank)
