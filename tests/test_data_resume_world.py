"""A loader's position carried to a job of another world size: the resumed ranks read the rest of the order.

Checked in one process, each rank's loader built as ``Accelerator.prepare`` builds it: a job of ``W`` ranks
saved after ``c`` steps (``c * W`` batches of the epoch's order read), resumed on ``W'`` ranks, reads, ranks
in order, the order's batches from ``c * W`` on (a map-style shuffle with a generator, a plain sequential
loader, a stream cut per global batch); where ``c * W`` does not divide by ``W'`` it starts a round earlier
and says how many batches it reads again. A stream split by node, whose ranks would read other shards at
another size, is an error naming both sizes.
"""

from __future__ import annotations

import logging
import types

import datasets
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from xshard.runtime.data import shard_data_loader

CPU = torch.device("cpu")
N, BATCH = 48, 2


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


def _loader(kind: str, batch: int = BATCH) -> DataLoader:
    if kind == "stream":
        return DataLoader(Stream(), batch_size=batch)
    data = TensorDataset(torch.arange(N))
    if kind == "generator":
        return DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(7))
    return DataLoader(data, batch_size=batch)


def _ids(batch) -> list[int]:
    return (batch[0] if isinstance(batch, list) else batch).tolist()


def _order(kind: str) -> list[int]:
    """The epoch's samples in the order one process reads them."""
    return [i for b in _loader(kind) for i in _ids(b)]


def _resumed_reads(kind: str, saved_world: int, steps: int, world: int, batch: int = BATCH) -> list[int]:
    """Save after ``steps`` steps on ``saved_world`` ranks; the samples ``world`` ranks read next, step by step,
    ranks in order (what a gather of the ids gives)."""
    states = []
    for rank in range(saved_world):
        loader = shard_data_loader(_loader(kind), CPU, saved_world, rank)
        for _, _ in zip(range(steps), loader, strict=False):
            pass
        states.append(loader.state_dict())
    positions = [(s["epoch"], s["batches_consumed"]) for s in states]
    assert positions == [positions[0]] * saved_world  # one position, the same on every rank
    assert states[0]["step_samples"] == saved_world * BATCH
    loaders = [shard_data_loader(_loader(kind, batch), CPU, world, rank) for rank in range(world)]
    for loader in loaders:
        loader.load_state_dict(states[0])
    return [i for step in zip(*loaders, strict=True) for batch in step for i in _ids(batch)]


@pytest.mark.parametrize("kind", ["generator", "sequential", "stream"])
@pytest.mark.parametrize("saved_world,steps,world", [(2, 3, 1), (2, 3, 3), (4, 2, 2), (1, 6, 3), (3, 2, 2)])
def test_a_job_of_another_size_reads_the_rest_of_the_epochs_order(kind, saved_world, steps, world, caplog):
    with caplog.at_level(logging.WARNING, logger="xshard"):
        read = _resumed_reads(kind, saved_world, steps, world)
    consumed = steps * saved_world
    start = consumed - consumed % world  # the round this job's ranks start at
    remaining = (N // BATCH - start) // world * world  # whole rounds (the epoch divides: no repeats at its end)
    order = _order(kind)
    assert read == order[start * BATCH:(start + remaining) * BATCH]
    again = [r.getMessage() for r in caplog.records if "read again" in r.getMessage()]
    if consumed % world:
        assert len(again) == world and f"reads {consumed % world * BATCH} of them again" in again[0]
    else:
        assert again == []


@pytest.mark.parametrize("kind", ["generator", "stream"])
def test_a_job_that_keeps_the_global_batch_on_fewer_ranks_resumes_at_the_same_sample(kind):
    """2 ranks of batch 2 saved after 3 steps (12 samples); 1 rank of batch 4 reads on from sample 12."""
    read = _resumed_reads(kind, 2, 3, 1, batch=4)
    assert read == _order(kind)[12:]


def test_a_stream_split_by_node_resumed_on_another_size_is_an_error_naming_both():
    stream = datasets.Dataset.from_dict({"x": list(range(16))}).to_iterable_dataset(num_shards=4)

    def prepared(world: int, rank: int):
        # every rank's counts alike (each rank's own stands in for the others': one process plays the world)
        agreement = types.SimpleNamespace(every_process_count=lambda mine: [mine] * world,
                                          main_process_value=lambda tensor: tensor)
        return shard_data_loader(DataLoader(stream, batch_size=2), CPU, world, rank, agreement=agreement)

    saved = prepared(2, 0)
    next(iter(saved))
    resumed = prepared(4, 0)
    with pytest.raises(ValueError, match=r"split by node over 2 processes, and this job has 4 .*resume on 2 processes"):
        resumed.load_state_dict(saved.state_dict())
