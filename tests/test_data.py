"""xshard.runtime.data: the distributed sampler, device placement, and mid-epoch resume."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from xshard.runtime.data import ShardSampler, move_to_device, shard_data_loader


def _rank_indices(n, world, **kw):
    return [list(ShardSampler(n, world, r, **kw)) for r in range(world)]


@pytest.mark.parametrize("n", [1, 7, 10, 16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_cover_the_dataset_with_equal_disjoint_slices(n, world, shuffle):
    per_rank = _rank_indices(n, world, shuffle=shuffle, seed=3)
    sizes = {len(p) for p in per_rank}
    assert sizes == {-(-n // world)}, "every rank gets the same number of samples (no rank waits alone)"
    flat = [i for p in per_rank for i in p]
    assert set(flat) == set(range(n))
    padding = len(flat) - n
    assert padding == (-n) % world  # only the wrap-around padding repeats samples
    assert len(flat) - len(set(flat)) == padding


@pytest.mark.parametrize("n,world", [(10, 3), (16, 4), (5, 2)])
def test_drop_last_gives_disjoint_slices_without_padding(n, world):
    per_rank = _rank_indices(n, world, shuffle=True, seed=0, drop_last=True)
    flat = [i for p in per_rank for i in p]
    assert len(flat) == len(set(flat)) == (n // world) * world


def test_rank_batches_together_are_the_single_process_batch():
    """Batch k of every rank together == batch k of one process with a world-times-larger batch."""
    n, world, b = 24, 3, 2
    single = list(ShardSampler(n, 1, 0, shuffle=True, seed=5))
    per_rank = _rank_indices(n, world, shuffle=True, seed=5)
    for k in range(n // (world * b)):
        union = sorted(i for p in per_rank for i in p[k * b:(k + 1) * b])
        assert union == sorted(single[k * world * b:(k + 1) * world * b])


def test_shuffle_is_seeded_and_changes_with_the_epoch():
    a, b = ShardSampler(50, 2, 1, shuffle=True, seed=7), ShardSampler(50, 2, 1, shuffle=True, seed=7)
    assert list(a) == list(b)
    assert list(a) != list(ShardSampler(50, 2, 1, shuffle=True, seed=8))
    epoch0 = list(a)
    a.set_epoch(1)
    other = ShardSampler(50, 2, 0, shuffle=True, seed=7)
    other.set_epoch(1)
    assert list(a) != epoch0 and sorted(list(a) + list(other)) == list(range(50))
    a.set_epoch(0)
    assert list(a) == epoch0
    assert list(ShardSampler(6, 2, 1)) == [1, 3, 5]  # no shuffle: dataset order


def _loader(n=20, batch=3, shuffle=True, drop_last=False):
    data = TensorDataset(torch.arange(n), torch.arange(n).float() * 2)
    return DataLoader(data, batch_size=batch, shuffle=shuffle, drop_last=drop_last)


def _ids(batches):
    return [b[0].tolist() for b in batches]


def test_prepared_loader_uses_a_seeded_shuffle_only_when_the_loader_shuffles():
    seq = shard_data_loader(_loader(shuffle=False), torch.device("cpu"), 2, 1, seed=0)
    assert _ids(seq)[0] == [3, 4, 5]  # rank 1 reads the second of every two batches
    one = _ids(shard_data_loader(_loader(), torch.device("cpu"), 2, 1, seed=4))
    two = _ids(shard_data_loader(_loader(), torch.device("cpu"), 2, 1, seed=4))
    assert one == two and one != _ids(seq)


def test_drop_last_of_the_loader_is_honoured():
    kept = shard_data_loader(_loader(n=10, batch=3, shuffle=False), torch.device("cpu"), 2, 0)
    dropped = shard_data_loader(_loader(n=10, batch=3, drop_last=True), torch.device("cpu"), 2, 0)
    # batches [0 1 2] [3 4 5] [6 7 8] [9]: the short last round is completed from the epoch's start
    assert _ids(kept) == [[0, 1, 2], [6, 7, 8]] and len(kept) == 2
    rank1 = shard_data_loader(_loader(n=10, batch=3, shuffle=False), torch.device("cpu"), 2, 1)
    assert _ids(rank1) == [[3, 4, 5], [9, 0, 1]]
    assert [len(b) for b in _ids(dropped)] == [3] and len(dropped) == 1


def test_epoch_advances_by_itself_and_set_epoch_is_respected():
    loader = shard_data_loader(_loader(), torch.device("cpu"), 2, 0, seed=1)
    first, second = _ids(loader), _ids(loader)
    assert first != second and loader.epoch == 2
    loader.set_epoch(0)
    assert _ids(loader) == first


def test_state_dict_resumes_mid_epoch_without_rereading():
    full = shard_data_loader(_loader(n=40), torch.device("cpu"), 2, 1, seed=9)
    reference_epoch0, reference_epoch1 = _ids(full), _ids(full)

    run = shard_data_loader(_loader(n=40), torch.device("cpu"), 2, 1, seed=9)
    seen = []
    for i, batch in enumerate(run):
        seen.append(batch[0].tolist())
        if i == 2:
            break
    state = run.state_dict()
    assert state == {"epoch": 0, "batches_consumed": 3, "world_size": 2, "step_samples": 6, "split_by_node": False}

    resumed = shard_data_loader(_loader(n=40), torch.device("cpu"), 2, 1, seed=9)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # a loop calling set_epoch with the resumed epoch keeps the position
    assert seen + _ids(resumed) == reference_epoch0
    assert _ids(resumed) == reference_epoch1


def test_end_of_epoch_is_true_only_on_the_last_batch():
    loader = shard_data_loader(_loader(n=12, batch=2), torch.device("cpu"), 2, 0)
    flags = [loader.end_of_epoch for _ in loader]
    assert flags == [False, False, True] and loader.end_of_epoch is False


def test_batches_are_moved_to_the_device_inside_containers():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2), "nested": [torch.zeros(1), (torch.ones(1), "label")], "pair": Pair(torch.ones(1), 3)}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["x"].is_meta and moved["nested"][0].is_meta and moved["nested"][1][0].is_meta
    assert moved["nested"][1][1] == "label" and isinstance(moved["nested"][1], tuple)
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.is_meta and moved["pair"].b == 3


def test_a_custom_batch_sampler_is_dealt_out_by_batches():
    data = TensorDataset(torch.arange(8))
    loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 2, False))
    assert _ids(shard_data_loader(loader, torch.device("cpu"), 2, 1)) == [[2, 3], [6, 7]]
    passthrough = shard_data_loader(loader, torch.device("cpu"), 2, 0, shard=False)
    assert len(_ids(passthrough)) == 4


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_sharded_loader_keeps_every_setting_of_the_users_loader(shuffle):
    """Only the batching changes: workers, prefetching, ordering, timeouts and hooks are the user's."""
    def init(worker_id: int) -> None:
        torch.manual_seed(worker_id)

    user = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=shuffle, num_workers=2,
                      prefetch_factor=3, persistent_workers=True, in_order=False, timeout=30.0,
                      worker_init_fn=init, multiprocessing_context="spawn", pin_memory_device="cpu")
    inner = shard_data_loader(user, torch.device("cpu"), 2, 1).loader
    for setting in ("num_workers", "prefetch_factor", "persistent_workers", "in_order", "timeout", "worker_init_fn",
                    "multiprocessing_context", "pin_memory_device", "collate_fn"):
        assert getattr(inner, setting) == getattr(user, setting), setting


def test_the_backend_wrapper_is_applied():
    wrapped = []

    def wrap(loader):
        wrapped.append(loader)
        return loader

    loader = shard_data_loader(_loader(), torch.device("cpu"), 1, 0, wrap=wrap)
    list(loader)
    assert len(wrapped) == 1 and isinstance(wrapped[0], DataLoader)


def test_forked_workers_are_flagged_only_on_interpreters_with_the_fork_deadlock(monkeypatch):
    """CPython before 3.11.10 can deadlock a forked worker (gh-112275); prepare() warns there (fork_may_deadlock)."""
    import multiprocessing
    import sys

    from xshard.runtime.data import fork_may_deadlock

    data = TensorDataset(torch.arange(8))
    forked = DataLoader(data, num_workers=2, multiprocessing_context="fork")
    monkeypatch.setattr(sys, "version_info", (3, 11, 7, "final", 0))
    assert fork_may_deadlock(forked)
    assert not fork_may_deadlock(DataLoader(data, num_workers=0))
    assert not fork_may_deadlock(DataLoader(data, num_workers=2, multiprocessing_context="forkserver"))
    assert fork_may_deadlock(DataLoader(data, num_workers=2)) == (multiprocessing.get_start_method() == "fork")
    monkeypatch.setattr(sys, "version_info", (3, 11, 10, "final", 0))
    assert not fork_may_deadlock(forked)
