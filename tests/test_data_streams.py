"""Streams (``IterableDataset``) on 2 and 4 real processes: every sample read once per pass, no rank left waiting.

- A torch ``IterableDataset`` is cut per global batch: each rank reads its slice of every window, all
  ranks take the same number of steps (a collective in every step), and every sample is read in each
  pass; only the samples that complete the last window are read twice.
- A ``datasets.IterableDataset`` with 4 shards of unequal sizes is split by node: each rank reads only its
  shards, the ranks whose part ends first read their first batch again until every rank's part has ended
  (no hang), and ``gather_for_metrics`` returns each sample exactly once.
- With 2 loader workers (a torch stream that splits itself among workers, torch's contract, and a
  ``datasets`` stream, which does): every sample read in each pass, and a loader resumed from its
  ``state_dict`` after 3 batches reads the uninterrupted run's batches from there on; without workers a
  ``datasets`` stream split by node resumes from its own state, also once a rank's part has ended.
"""

from __future__ import annotations

from collections import Counter

import pytest
from support.distributed import run_workers
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

pytestmark = pytest.mark.multiprocess


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter({"id": i} for i in range(self.n))


class WorkerSplitStream(Stream):
    """A stream that gives each loader worker its own part (``get_worker_info``), as torch asks of streams."""

    def __iter__(self):
        info = get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        return iter({"id": i} for i in ids)


def _worker(rank, world_size, kind, n, batch, workers=0, resume_at=None):
    import xshard

    acc = xshard.Accelerator(stage=0, seed=0)

    def prepared():
        if kind == "torch":
            dataset = WorkerSplitStream(n) if workers else Stream(n)
        else:
            from datasets import Dataset

            dataset = Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=4)
        return acc.prepare(DataLoader(dataset, batch_size=batch, num_workers=workers))

    loader = prepared()
    passes = []
    for _ in range(2):
        read, kept = [], []
        for b in loader:
            read.append(b["id"].tolist())
            kept += acc.gather_for_metrics(acc.pad_across_processes(b["id"], pad_index=-1)).tolist()
        passes.append((read, kept))
    if resume_at is None:
        return passes
    interrupted = prepared()
    for _, _ in zip(range(resume_at), interrupted, strict=False):
        pass
    resumed = prepared()
    resumed.load_state_dict(interrupted.state_dict())
    resumed.load_rank_state_dict(interrupted.rank_state_dict())  # what a checkpoint keeps of each rank
    return passes, [[b["id"].tolist() for b in resumed] for _ in range(2)]


@pytest.mark.parametrize("world", [2, 4])
def test_a_torch_stream_is_read_once_per_pass_in_slices_of_each_global_batch(world):
    n, batch = 37, 3
    ranks = run_workers(_worker, world, "torch", n, batch)
    for p in range(2):
        reads = [rank[p][0] for rank in ranks]
        assert len({len(r) for r in reads}) == 1  # every rank the same number of steps
        counts = Counter(i for r in reads for b in r for i in b)
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == -n % (batch * world)  # only the last window's completion repeats


@pytest.mark.parametrize("world", [2, 4])
def test_a_datasets_stream_is_split_by_node_and_uneven_ends_do_not_hang(world):
    n, batch = 37, 3  # 4 shards of 10, 9, 9, 9 samples: the ranks' parts end at different steps
    ranks = run_workers(_worker, world, "datasets", n, batch)
    for p in range(2):
        reads = [rank[p][0] for rank in ranks]
        assert len({len(r) for r in reads}) == 1
        firsts = [r[0] for r in reads]
        for r, read in enumerate(reads):  # past its own part, a rank reads its first batch again
            own = [b for b in read if b != firsts[r]]
            assert all(b == firsts[r] for b in read[len(own) + 1:])
        assert set(i for r in reads for b in r for i in b) == set(range(n))
        assert sorted(ranks[0][p][1]) == list(range(n))  # gather_for_metrics: each sample once


@pytest.mark.parametrize("kind", ["torch", "datasets"])
def test_a_stream_read_by_two_workers_is_read_once_per_pass_and_resumes_mid_epoch(kind):
    n, batch, world = 37, 3, 2
    ranks = run_workers(_worker, world, kind, n, batch, 2, 3)
    for p in range(2):
        reads = [passes[p][0] for passes, _ in ranks]
        assert len({len(r) for r in reads}) == 1
        assert set(i for r in reads for b in r for i in b) == set(range(n))
        if kind == "datasets":
            assert sorted(ranks[0][0][p][1]) == list(range(n))  # gather_for_metrics: each sample once
    for passes, resumed in ranks:
        assert resumed == [passes[0][0][3:], passes[1][0]]  # the uninterrupted batches from the 4th on


@pytest.mark.parametrize("resume_at", [3, 6])
def test_a_datasets_stream_split_by_node_resumes_from_its_own_state_where_its_ranks_end_apart(resume_at):
    """Without workers each rank's stream restarts from its own state_dict(); after 6 steps rank 1's part (18
    samples, 6 batches) has ended while rank 0's (19) has one more batch: rank 1 reads its pass again to have its
    first batch to repeat, and both read the uninterrupted run's batches."""
    ranks = run_workers(_worker, 2, "datasets", 37, 3, 0, resume_at)
    for passes, resumed in ranks:
        assert resumed == [passes[0][0][resume_at:], passes[1][0]]
