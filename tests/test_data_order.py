"""Every rank reads the batches Accelerate's prepared loader gives it, for every kind of loader a user builds.

Checked in one process against Accelerate's ``prepare_data_loader`` on the same loader (each process
reading its own batches: ``BatchSamplerShard`` for map-style loaders, ``SeedableRandomSampler`` for a plain
``shuffle=True`` where asked, ``IterableDatasetShard`` for streams), for worlds of 2 to 4 ranks, short last
batches, ``drop_last`` and ``split_batches``:

- rank ``r``'s batches of each epoch equal Accelerate's rank ``r``'s: a sequential loader, a seeded
  ``shuffle=True``, a ``WeightedRandomSampler`` and transformers' ``LengthGroupedSampler`` with a seeded
  generator, a bucketing ``batch_sampler``; a stream's windows;
- the real samples of each step (``real_counts``: what ``gather_for_metrics`` keeps), ranks in order, are
  the batches one process draws, each sample once;
- a loader that cannot be sharded (a sampler without a length, a stream the loader does not batch) is an
  error that names the loader, the reason and the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset, WeightedRandomSampler

from xshard.runtime.data import shard_data_loader

CPU = torch.device("cpu")


class Buckets(Sampler[list[int]]):
    """A user's bucketing batch sampler: batches of samples of one length bucket, shuffled by a generator."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator) -> None:
        self.n, self.batch_size, self.drop_last, self.generator = n, batch_size, False, generator

    def _all(self) -> list[list[int]]:
        by_bucket = [[i for i in range(self.n) if i % 3 == b] for b in range(3)]
        batches = [bucket[i:i + self.batch_size] for bucket in by_bucket
                   for i in range(0, len(bucket) - self.batch_size + 1, self.batch_size)]
        return [batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist()]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return sum(len([i for i in range(self.n) if i % 3 == b]) // self.batch_size for b in range(3))


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kind(kind: str, n: int, batch: int, drop_last: bool) -> DataLoader:
    data = _data(n)
    if kind == "sequential":
        return DataLoader(data, batch_size=batch, drop_last=drop_last)
    if kind == "generator":
        return DataLoader(data, batch_size=batch, shuffle=True, generator=_seeded(), drop_last=drop_last)
    if kind == "weighted":
        weights = torch.linspace(0.1, 1.0, n)
        return DataLoader(data, batch_size=batch, drop_last=drop_last,
                          sampler=WeightedRandomSampler(weights, n, replacement=True, generator=_seeded()))
    if kind == "length_grouped":
        from transformers.trainer_pt_utils import LengthGroupedSampler

        lengths = [(i * 7) % 11 + 1 for i in range(n)]
        return DataLoader(data, batch_size=batch, drop_last=drop_last,
                          sampler=LengthGroupedSampler(batch, lengths=lengths, generator=_seeded()))
    assert kind == "buckets"
    return DataLoader(data, batch_sampler=Buckets(n, batch, _seeded()))


def _ours(loader_of, world: int, split: bool = False, epochs: int = 2) -> list[list[list[list[int]]]]:
    """[rank][epoch] -> batches of sample ids."""
    out = []
    for rank in range(world):
        loader = shard_data_loader(loader_of(), CPU, world, rank, seed=5, split_batches=split)
        out.append([[b[0].tolist() for b in loader] for _ in range(epochs)])
    return out


def _accelerate(loader_of, world: int, split: bool = False, epochs: int = 2, **options) -> list:
    """The same, from Accelerate's ``prepare_data_loader`` (each process reading its own batches)."""
    from accelerate.data_loader import prepare_data_loader

    out = []
    for rank in range(world):
        loader = prepare_data_loader(loader_of(), num_processes=world, process_index=rank, split_batches=split,
                                     put_on_device=False, dispatch_batches=False, even_batches=True, **options)
        out.append([[_ids(b) for b in loader] for _ in range(epochs)])
    return out


def _ids(batch) -> list[int]:
    return (batch[0] if isinstance(batch, list) else batch).tolist()


@pytest.mark.parametrize("kind", ["sequential", "generator", "weighted", "length_grouped", "buckets"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n,batch,drop_last", [(24, 3, False), (23, 3, False), (10, 4, False), (23, 3, True)])
def test_each_rank_reads_accelerates_batches(kind, world, n, batch, drop_last):
    ours = _ours(lambda: _kind(kind, n, batch, drop_last), world)
    theirs = _accelerate(lambda: _kind(kind, n, batch, drop_last), world)
    assert ours == theirs
    assert len({len(per_epoch[0]) for per_epoch in ours}) == 1  # every rank the same number of steps


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n,batch,drop_last", [(24, 4, False), (22, 4, False), (22, 4, True)])
def test_split_batches_give_each_rank_its_slice_of_accelerates_batches(world, n, batch, drop_last):
    ours = _ours(lambda: _kind("generator", n, batch, drop_last), world, split=True)
    theirs = _accelerate(lambda: _kind("generator", n, batch, drop_last), world, split=True)
    assert ours == theirs


def test_a_plain_shuffle_is_accelerates_seedable_order():
    """``shuffle=True`` without a generator: seed + epoch, as ``SeedableRandomSampler(data_seed=seed)``."""
    ours = _ours(lambda: DataLoader(_data(30), batch_size=4, shuffle=True), 2, epochs=3)
    theirs = _accelerate(lambda: DataLoader(_data(30), batch_size=4, shuffle=True), 2, epochs=3,
                         use_seedable_sampler=True, data_seed=5)
    assert ours == theirs
    assert ours[0][0] != ours[0][1]  # a new order each epoch


def _steps_kept(loader_of, world: int) -> list[int]:
    """The samples a gather_for_metrics keeps over one epoch: each rank's real rows of each step, ranks in order."""
    loaders = [shard_data_loader(loader_of(), CPU, world, r) for r in range(world)]
    iterators = [iter(loader) for loader in loaders]
    kept: list[int] = []
    for batches in zip(*iterators, strict=True):
        counts, _ = loaders[0].real_counts()
        kept += [i for r, b in enumerate(batches) for i in b[0].tolist()[:counts[r]]]
    return kept


@pytest.mark.parametrize("kind", ["sequential", "generator", "buckets"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_real_samples_of_each_step_are_the_one_process_order_each_once(kind, world):
    one_process = [i for b in _kind(kind, 23, 3, False) for i in b[0].tolist()]
    assert _steps_kept(lambda: _kind(kind, 23, 3, False), world) == one_process


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n,batch,drop_last,split", [(24, 3, False, False), (25, 3, False, False), (25, 3, True, False),
                                                     (5, 2, False, False), (26, 4, False, True), (26, 4, True, True)])
def test_a_stream_is_sliced_per_global_batch_as_accelerate_slices_it(world, n, batch, drop_last, split):
    if split and batch % world:
        pytest.skip("split_batches needs a batch that divides over the ranks")
    ours, theirs = [], []
    for rank in range(world):
        loader = shard_data_loader(DataLoader(Stream(n), batch_size=batch, drop_last=drop_last), CPU, world, rank,
                                   split_batches=split)
        ours.append([b.tolist() for b in loader])
    theirs = [per_epoch[0] for per_epoch in
              _accelerate(lambda: DataLoader(Stream(n), batch_size=batch, drop_last=drop_last), world, split, 1)]
    assert ours == theirs
    assert len({len(batches) for batches in ours}) == 1  # no rank has a step the others lack
    read = [i for batches in ours for b in batches for i in b]
    assert set(read) >= set(range(n - (n % (batch * (1 if split else world)) if drop_last else 0)))


@pytest.mark.parametrize("world", [2, 3])
def test_a_sampler_that_draws_one_ranks_share_is_read_whole_by_that_rank(world):
    """A ``DistributedSampler`` the script built: each rank reads its own share once (sharded again, as
    Accelerate's ``BatchSamplerShard`` does, each rank would read a third or half of it)."""
    from torch.utils.data import DistributedSampler

    def loader(rank: int) -> DataLoader:
        sampler = DistributedSampler(_data(23), num_replicas=world, rank=rank, shuffle=True, seed=3)
        return DataLoader(_data(23), batch_size=3, sampler=sampler)

    ours = [[b[0].tolist() for b in shard_data_loader(loader(r), CPU, world, r)] for r in range(world)]
    plain = [[b[0].tolist() for b in loader(r)] for r in range(world)]
    assert ours == plain
    assert set(i for batches in ours for b in batches for i in b) == set(range(23))


def test_a_sampler_built_for_another_world_is_an_error_naming_both():
    from torch.utils.data import DistributedSampler

    loader = DataLoader(_data(8), batch_size=2, sampler=DistributedSampler(_data(8), num_replicas=4, rank=1))
    with pytest.raises(ValueError, match=r"DistributedSampler draws the share of rank 1 of 4 processes, but this is "
                                         r"rank 0 of 2; build it with num_replicas=2, rank=0"):
        shard_data_loader(loader, CPU, 2, 0)


class Endless(Sampler[int]):
    def __iter__(self):
        i = 0
        while True:
            yield i % 4
            i += 1


def test_a_sampler_without_a_length_is_an_error_naming_the_loader_the_reason_and_the_fix():
    loader = DataLoader(_data(8), batch_size=2, sampler=Endless())
    with pytest.raises(ValueError, match=r"DataLoader over TensorDataset: its Endless has no length.*shard=False"):
        shard_data_loader(loader, CPU, 2, 0)


def test_a_stream_the_loader_does_not_batch_is_an_error_naming_the_fix():
    loader = DataLoader(Stream(8), batch_size=None)
    with pytest.raises(ValueError, match=r"DataLoader over Stream: .*batch_size=None.*shard=False"):
        shard_data_loader(loader, CPU, 2, 0)


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_sized_stream_has_accelerates_number_of_batches(drop_last):
    ours = shard_data_loader(DataLoader(SizedStream(25), batch_size=3, drop_last=drop_last), CPU, 2, 1)
    from accelerate.data_loader import prepare_data_loader

    theirs = prepare_data_loader(DataLoader(SizedStream(25), batch_size=3, drop_last=drop_last), num_processes=2,
                                 process_index=1, put_on_device=False, dispatch_batches=False)
    assert len(ours) == len(theirs) == len([b for b in ours])


@pytest.mark.parametrize("split", [False, True])
def test_one_process_reads_the_loaders_own_batches_a_short_last_one_included(split):
    loader = shard_data_loader(DataLoader(_data(10), batch_size=4), CPU, 1, 0, split_batches=split)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and len(loader) == 3
