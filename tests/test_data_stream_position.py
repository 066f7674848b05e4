"""A stream with its own ``state_dict()`` resumes where it was, without reading its consumed batches again.

Checked in one process, each rank's loader built as ``Accelerator.prepare`` builds it and resumed from its
``state_dict()`` and ``rank_state_dict()`` (what a checkpoint keeps): a ``datasets`` stream of 8 shards on one
process, and a torch stream with ``state_dict()`` cut per global batch on 2 ranks, both read after the resume
exactly the uninterrupted run's batches, and the stream opens none of the shards (reads none of the samples)
that the batches before the resume used. With loader workers the stream's state stays in the workers: the
resume reads the consumed batches again and still gives the uninterrupted batches.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from xshard.runtime.data import shard_data_loader

CPU = torch.device("cpu")
OPENED: list[int] = []  # the shards a datasets stream's generator opened, in order (one process: no workers)


def _shard(shard: list[int]):
    OPENED.append(shard[0])
    for i in range(shard[0] * 6, shard[0] * 6 + 6):
        yield {"id": i}


def _datasets_stream():
    return datasets.IterableDataset.from_generator(_shard, gen_kwargs={"shard": list(range(8))})


class Counted(IterableDataset):
    """A stream of 40 ids that knows its position (``state_dict``) and records every id it reads."""

    def __init__(self) -> None:
        self.position, self.read = 0, []

    def __iter__(self):
        while self.position < 40:
            self.position += 1
            self.read.append(self.position - 1)
            yield {"id": self.position - 1}
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _ids(batches) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def _resume(make, world: int, rank: int, steps: int, workers: int = 0):
    """(the uninterrupted pass's batches, the batches a loader resumed after ``steps`` reads, its dataset)."""
    def prepared(dataset):
        return shard_data_loader(DataLoader(dataset, batch_size=4, num_workers=workers), CPU, world, rank)

    uninterrupted = _ids(prepared(make()))
    interrupted = prepared(make())
    for _, _ in zip(range(steps), interrupted, strict=False):
        pass
    dataset = make()
    resumed = prepared(dataset)
    resumed.load_state_dict(interrupted.state_dict())
    resumed.load_rank_state_dict(interrupted.rank_state_dict())
    return uninterrupted, _ids(resumed), dataset


def test_a_datasets_stream_resumes_at_its_shard_without_opening_the_consumed_ones():
    OPENED.clear()
    uninterrupted, resumed, _ = _resume(_datasets_stream, 1, 0, steps=3)  # 12 samples: shards 0 and 1
    assert resumed == uninterrupted[3:]
    # the uninterrupted pass and the interrupted one (3 batches and 1 read ahead) opened 0..7 and 0..2; the
    # stream's state after shard 1's last sample is "shard 1, 6 samples in": the resumed pass opens shard 1 (and
    # steps past its samples), never shard 0
    assert OPENED == [*range(8), 0, 1, 2, *range(1, 8)]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stateful_stream_cut_per_global_batch_resumes_without_reading_the_consumed_windows(rank):
    uninterrupted, resumed, dataset = _resume(Counted, 2, rank, steps=2)  # windows of 8: 16 samples used
    assert resumed == uninterrupted[2:]
    assert dataset.read == list(range(16, 40))


def test_a_stateful_stream_read_by_workers_resumes_by_reading_again():
    uninterrupted, resumed, _ = _resume(Counted, 2, 1, steps=2, workers=1)
    assert resumed == uninterrupted[2:]
