"""Data loading for data-parallel jobs: one disjoint share per rank, batches on the right device.

``shard_data_loader`` gives each rank its share of a user's DataLoader as Accelerate does: of every ``W``
consecutive batches that one process would draw from the loader (any ``sampler``, any ``batch_sampler``),
rank ``r`` reads the ``r``-th (``xshard.runtime.batch_order``); a stream is split by node or cut per global
batch (``xshard.runtime.stream_shard``). ``ShardSampler`` is the per-sample split (rank ``r`` reads
``order[r::W]``, DistributedSampler's way) for code that builds its own loaders.

``ShardedDataLoader`` wraps a rebuilt ``torch.utils.data.DataLoader`` (same dataset, this rank's batches,
collate function, workers) and adds what training needs:

- batches moved to the device (tensors inside dicts, lists, tuples, named tuples, HF ``BatchEncoding``);
- a torch ``DataLoader``'s iterator protocol, as Accelerate's prepared loader keeps it: each ``iter()`` starts a
  new pass (a ``break`` ends the pass, ``next()`` past the last batch raises ``StopIteration``), and the epoch
  (``iteration`` in Accelerate's name) advances by itself when a pass completes (``set_epoch`` still works), so
  each epoch has a new shuffle without user code; the one exception is the pass after ``load_state_dict`` or
  ``skip_first_batches``, which resumes its epoch where the position says;
- the position (epoch and batches consumed) is remembered: ``state_dict()`` / ``load_state_dict()``
  resume mid-epoch without reading the skipped samples again (a stream restarts from its own
  ``state_dict()`` where it has one, ``stream_position``, else reads and drops them), also on another
  world size (the position is carried over in samples of the epoch's order);
- the RNG draw each pass makes (the workers' base seed, from torch's global RNG when the loader has no
  generator) happens once per epoch, as in a loop that is not interrupted: a pass that continues an
  epoch replays the epoch's draw (``IteratorSeed``), so a resumed run's dropout masks and workers' seeds
  are the uninterrupted run's;
- ``end_of_epoch`` is True while the last batch of an epoch is being used (the Accelerator syncs
  gradients there even when the accumulation window is not full);
- ``real_counts()`` says, for the batch in use, how many of each rank's samples are real rather
  than the repeats that even out the last batches (``gather_for_metrics`` drops those).
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import sys
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from ..sharding.trees import map_leaves
from .batch_order import EpochBatches, RankBatches
from .iterator_seed import IteratorSeed
from .loader_job import ALONE, LoaderAgreement, PassOrder
from .loader_surface import AccelerateLoaderMembers
from .rank_logging import get_logger
from .stream_position import StreamPosition
from .stream_shard import StreamShard, split_by_node, splits_by_node

_log = get_logger("xshard.data")


class ShardSampler(Sampler[int]):
    """Rank ``rank`` of ``num_replicas``: a disjoint, deterministic slice of each epoch's order.

    Args:
        length: number of samples in the dataset.
        num_replicas, rank: the data-parallel world.
        shuffle: a seeded permutation per epoch (``seed + epoch``), the same on every rank.
        seed: the shuffle seed.
        drop_last: drop the tail that does not divide evenly over ranks; otherwise the order is
            padded by wrapping around, so every rank gets the same number of samples (a rank with
            fewer batches would leave the others waiting in a collective).
    """

    def __init__(
        self, length: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = False, seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ShardSampler: rank {rank} is not in a world of {num_replicas}")
        self.length = int(length)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0  # samples of this rank's slice to skip (resume mid-epoch)

    @property
    def num_samples(self) -> int:
        """Samples per rank per epoch (before any skip)."""
        if self.drop_last:
            return self.length // self.num_replicas
        return math.ceil(self.length / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order (the shuffle seed is ``seed + epoch``)."""
        self.epoch = int(epoch)

    def order(self) -> list[int]:
        """This epoch's order over the whole dataset, trimmed or padded to a multiple of the world."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        total = self.num_samples * self.num_replicas
        if total <= len(order):
            return order[:total]
        if not order:
            return order
        repeats = math.ceil((total - len(order)) / len(order))
        return order + (order * repeats)[: total - len(order)]

    def real_count(self, rank: int, start: int, end: int) -> int:
        """How many of rank ``rank``'s samples ``start..end-1`` (of its epoch slice) are real, not repeats.

        Local sample ``i`` of rank ``r`` is position ``i * num_replicas + r`` of the padded order; the
        positions past the dataset's length are the wrap-around repeats.
        """
        return sum(1 for i in range(start, end) if i * self.num_replicas + rank < self.length)

    def __iter__(self) -> Iterator[int]:
        mine = self.order()[self.rank :: self.num_replicas]
        return iter(mine[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in ``batch`` (nested dicts, lists, tuples, named tuples) to ``device``."""
    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=non_blocking)
        if hasattr(x, "to") and callable(x.to) and not isinstance(x, type):
            try:
                return x.to(device)  # objects with their own .to()
            except TypeError:
                return x
        return x

    return map_leaves(batch, move)


def _rebuild(loader: DataLoader, dataset: Any, batching: dict[str, Any],
             pad_to_multiple_of: int | None = None) -> DataLoader:
    """The same DataLoader over ``dataset`` with ``batching`` (``batch_sampler=...``, or ``batch_size`` and
    ``drop_last``) in place of its own; every other setting kept but the collate function, wrapped to pad
    token batches to a multiple of ``pad_to_multiple_of`` when one is given: ``xshard.static_shapes``)."""
    collate_fn = loader.collate_fn
    if pad_to_multiple_of:
        from ..static_shapes import PadToMultiple

        if not isinstance(collate_fn, PadToMultiple):  # the user's own hook (tensors named) is kept
            collate_fn = PadToMultiple(collate_fn, pad_to_multiple_of)
    kwargs: dict[str, Any] = {
        **batching,
        "num_workers": loader.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "in_order": loader.in_order,
    }
    if loader.pin_memory_device:  # an empty string is torch's default (the accelerator's device)
        kwargs["pin_memory_device"] = loader.pin_memory_device
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(dataset, **kwargs)


class ShardedDataLoader(AccelerateLoaderMembers):
    """A DataLoader that shards over ranks, places batches on the device and remembers its position.

    Build it with ``shard_data_loader`` (``Accelerator.prepare`` does). Each ``iter()`` is a new pass over this
    rank's batches of the current epoch; the pass after ``load_state_dict`` / ``skip_first_batches`` starts
    after the batches that position consumed.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        sampler: RankBatches | None,
        wrap: Callable[[Any], Any] = lambda x: x,
        non_blocking: bool | None = None,
        batch_size: int | None = None,
        stream: StreamShard | None = None,
        agreement: LoaderAgreement | None = None,
        num_replicas: int = 1,
        split_batches: bool = False,
        pass_order: PassOrder | None = None,
    ) -> None:
        self.loader = loader
        #: the world the position is counted in (a resume on another world size converts it: ``load_state_dict``)
        self.num_replicas = num_replicas
        self._split_batches = split_batches
        self.device = device
        self.sampler = sampler
        self.stream = stream
        #: for a stream whose ranks may end apart: the job's agreement, asked for every rank's (real samples,
        #: samples) in its next batch (a collective); None where the ranks end together
        self._agreement = agreement
        self._first: Any = None  # the pass's first batch: what a rank whose stream ended reads again
        self._counts: list[list[tuple[int, int]]] = []  # the exchanged counts of the batch in use and the one ahead
        self._batch_size = loader.batch_size if batch_size is None else batch_size
        self._wrap = wrap
        self._non_blocking = non_blocking
        self.epoch = 0
        self.batches_consumed = 0
        self.end_of_epoch = False
        #: True between the first and the last batch of a pass; ``iteration_order`` orders the
        #: passes of the job's loaders (its ``PassOrder``), so the one started last is the one being used
        #: (nested loops)
        self.in_iteration = False
        self.iteration_order = 0
        self._pass_order = pass_order if pass_order is not None else PassOrder()
        #: this rank's record of the epoch's base-seed draw (checkpointed with the rank's RNG states)
        self.iterator_seed = IteratorSeed(loader)
        #: a stateful stream's own position per batch (``stream_position``; kept with the rank's RNG states)
        self.stream_position = StreamPosition(
            stream.dataset if stream is not None else loader.dataset if isinstance(loader.dataset, IterableDataset)
            else None, loader.num_workers)
        self._read = 0  # batches of the epoch read from the loader so far (one ahead of those in use)
        #: where the next pass starts in its epoch when it resumes one (``load_state_dict``, ``resume_at``)
        self._resume_at: int | None = None
        self._passes = 0  # passes started; a pass's iterator updates the loader only while it is the latest

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        """Batch size per rank (the global batch is this times the world size)."""
        return self._batch_size

    def __len__(self) -> int:
        """Batches per rank in a whole epoch."""
        if self.sampler is None:
            return len(self.loader)
        return self.sampler.total()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a different shuffle). Setting the current epoch again keeps the
        position, so ``set_epoch`` in a loop after ``load_state_dict`` resumes mid-epoch."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.batches_consumed = 0
            self._resume_at = None

    @property
    def iteration(self) -> int:
        """The epoch, in Accelerate's name (``DataLoaderShard.iteration``: passes completed, or ``set_epoch``'s)."""
        return self.epoch

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.set_epoch(value)

    @property
    def end_of_dataloader(self) -> bool:
        """True while the pass's last batch is in use (Accelerate's name for ``end_of_epoch``)."""
        return self.end_of_epoch

    @property
    def remainder(self) -> int:
        """Samples in the epoch's last global batch (the dataset's length modulo ``total_batch_size``), once a
        pass has started; -1 before, for a loader that drops its last batch, or of unknown length: Accelerate's
        ``remainder``."""
        drop_last = self.sampler.source.drop_last if self.sampler is not None else self.loader.drop_last
        total = self.total_batch_size
        if not self._passes or drop_last or not total:
            return -1
        try:
            return int(getattr(self.dataset, "total_length", None) or len(self.dataset)) % total
        except TypeError:  # a stream without a length
            return -1

    @property
    def skip_batches(self) -> int:
        """Batches of the epoch the next pass skips (a position ``load_state_dict`` or ``skip_first_batches``
        set), Accelerate's ``skip_batches``."""
        return self._resume_at or 0

    def resume_at(self, num_batches: int) -> None:
        """The next pass resumes the current epoch after its first ``num_batches`` batches (not before the
        position ``load_state_dict`` restored, if one is pending), drawing the epoch's order again."""
        self._resume_at = max(self._resume_at or 0, int(num_batches))

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: ``{"epoch", "batches_consumed"}`` (the same on every rank), and the
        ``generator_state`` its epoch's order was drawn from when the user's sampler draws it. The
        rank's own record of its epoch's base-seed draw is ``iterator_seed.state_dict()`` (a checkpoint
        keeps it with the rank's RNG states)."""
        state: dict[str, Any] = {"epoch": self.epoch, "batches_consumed": self.batches_consumed,
                                 "world_size": self.num_replicas, "step_samples": self._step_samples(),
                                 "split_by_node": self._agreement is not None}
        if self.sampler is not None:
            state.update(self.sampler.source.state_dict())
        return state

    def rank_state_dict(self) -> dict[str, Any]:
        """What this rank alone knows of its position: its epoch's base-seed draw (``IteratorSeed``) and, for
        a stateful stream, the stream's own state after the batch in use (``StreamPosition``)."""
        return {**self.iterator_seed.state_dict(),
                **self.stream_position.state_dict(self.epoch, self.batches_consumed)}

    def load_rank_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Take back ``rank_state_dict()``'s record (None: an older checkpoint; the next pass draws afresh and a
        stream reads its consumed batches again)."""
        self.iterator_seed.load_state_dict(state)
        self.stream_position.load_state_dict(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``: the next pass starts after ``batches_consumed`` batches of ``epoch``.

        Saved by a job of another world size or batch size, the position is carried over in samples of the
        epoch's order: ``batches_consumed`` steps that each read ``S`` samples of the order (``S`` = batch size
        times world size; the loader's batch with ``split_batches``) are ``batches_consumed * S`` samples, read
        from there on by this job's steps (where that does not divide by this job's ``S``, the pass starts at
        the step before, and those samples are read again: a warning says how many). A stream split by node
        cannot be carried over (its ranks read other files at another size): an error.
        """
        self.epoch = int(state["epoch"])
        self.batches_consumed = self._carried_over(state)
        if self.sampler is not None:
            # (a checkpoint written before the draw's epoch was saved: the draw is the position's epoch's)
            self.sampler.source.load_state_dict({"generator_epoch": self.epoch, **state})
        if self.sampler is not None and 0 < len(self) <= self.batches_consumed:
            # Saved on the epoch's last batch: the next pass is the next epoch, as it is uninterrupted (and
            # as a loop that counts its epoch and skip from the step, ``divmod(step, len(loader))``, expects);
            # its draw first moves the generator past the saved epoch's (``EpochBatches``).
            self.epoch, self.batches_consumed = self.epoch + 1, 0
        self._resume_at = self.batches_consumed

    def _step_samples(self) -> int | None:
        """Samples of the epoch's order one step reads over all ranks (None: batches of unknown size)."""
        return None if self._batch_size is None else self._batch_size * self.num_replicas

    def _carried_over(self, state: Mapping[str, Any]) -> int:
        """The saved position (steps of the saving job), as steps of this job."""
        consumed, saved_world = int(state["batches_consumed"]), int(state.get("world_size", self.num_replicas))
        saved_step, step = state.get("step_samples", self._step_samples()), self._step_samples()
        if (saved_world, saved_step) == (self.num_replicas, step):
            return consumed
        if state.get("split_by_node") or self._agreement is not None:
            raise ValueError(
                f"{_name(self.loader)}: the checkpoint's position is in the stream's split by node over {saved_world} "
                f"processes, and this job has {self.num_replicas} (each would read other shards): resume on "
                f"{saved_world} processes")
        if self.sampler is not None and self.sampler.source.plain and self.sampler.seed is None:
            _log.warning(
                "%s: the checkpoint was saved by %d processes and this job has %d; a plain shuffle=True draws "
                "Accelerate's default order, which differs between process counts, so the resumed epochs read "
                "another order; DataLoaderConfiguration(use_seedable_sampler=True) gives one order on any number "
                "of processes", _name(self.loader), saved_world, self.num_replicas, main_process_only=True)
        if saved_step is None or step is None:  # batches of unknown size: counted in the loader's batches
            saved_step, step = (1, 1) if self._split_batches else (saved_world, self.num_replicas)
        steps, again = divmod(consumed * saved_step, step)
        if again:
            _log.warning(
                "%s: saved after %d steps reading %d samples (or batches) of the epoch's order each; a step of this "
                "job reads %d, so it resumes after %d steps and reads %d of them again", _name(self.loader), consumed,
                saved_step, step, steps, again, main_process_only=True)
        return steps

    def real_counts(self) -> tuple[list[int], int] | None:
        """(per rank, the real samples of the batch in use; the batch's samples per rank): the others
        repeat samples to even out the last batch. None when the loader is not sharded by index."""
        if not self.in_iteration or self.batches_consumed == 0:
            return None
        if self._agreement is not None and self._counts:
            return [real for real, _ in self._counts[0]], max(size for _, size in self._counts[0])
        if self.sampler is None:
            return None
        return self.sampler.real.get(self.batches_consumed - 1)

    def skip_first_batches(self, num_batches: int) -> _SkipFirst:
        """One pass over the current epoch from batch ``num_batches`` (counted from the epoch's start).

        The position is absolute, so skipping to where ``load_state`` already resumed skips nothing
        more.
        """
        return _SkipFirst(self, num_batches)

    def __iter__(self) -> Iterator[Any]:
        # A new pass (torch's protocol), unless a position is pending: then this pass resumes its epoch there.
        start, self._resume_at = self._resume_at or 0, None
        self.batches_consumed = start
        self._passes += 1
        this_pass = self._passes
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = start
            self.sampler.fresh = start == 0
        if self.stream is not None:
            self.stream.set_epoch(self.epoch)
        elif self._agreement is not None:
            set_epoch = getattr(self.loader.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)  # a stream split by node: its shuffle follows the epoch
        first = _EXHAUSTED
        if self._agreement is not None and self.stream_position.restorable(self.epoch, self.batches_consumed):
            # A rank whose part ends before the others' reads its pass's first batch again (``_next``): read it
            # from the pass's start before the stream jumps to where it was saved.
            with self.iterator_seed.drawing(starts_epoch=False):
                first = next(iter(self._wrap(self.loader)), _EXHAUSTED)
        restored = self.stream_position.resume(self.epoch, self.batches_consumed)
        # Where the consumed batches are skipped: a sampler or a stream cut here skips them unread; a stream
        # restored from its own state has none to skip; any other loader reads them again and drops them here,
        # as does a stream read by workers (each worker iterates its own copy, torch's contract, and the loader
        # takes their batches in turn: a skip inside the copies would skip each worker's first batches).
        skip_here = not restored and self.sampler is None and (self.stream is None or self.loader.num_workers > 0)
        if self.stream is not None:
            self.stream.start = 0 if restored or skip_here else self.batches_consumed
        self.end_of_epoch = False
        self._first, self._counts = (None if first is _EXHAUSTED else first), []
        with self.iterator_seed.drawing(starts_epoch=start == 0):
            source = iter(self._wrap(self.loader))
        non_blocking = bool(self.loader.pin_memory) if self._non_blocking is None else self._non_blocking
        self.iteration_order = self._pass_order.next()
        if skip_here:  # a stream split by node or read by workers, or a loader not sharded here (a stream on
            # one process, ``shard=False``), resumes by reading its consumed batches again
            for _ in range(self.batches_consumed):
                skipped = next(source, _EXHAUSTED)
                self._first = skipped if self._first is None and skipped is not _EXHAUSTED else self._first
        self._read = self.batches_consumed
        # Look one batch ahead so the last batch is known while it is in use.
        upcoming = self._next(source)
        self.in_iteration = upcoming is not _EXHAUSTED
        try:
            while upcoming is not _EXHAUSTED:
                current = upcoming
                upcoming = self._next(source)
                self.end_of_epoch = upcoming is _EXHAUSTED
                self.batches_consumed += 1
                yield move_to_device(current, self.device, non_blocking)
        finally:  # also when the loop breaks out early, or a later pass has replaced this one
            if self._passes == this_pass:
                self.in_iteration = False
        if self._passes == this_pass:  # the pass completed: the next one is the next epoch
            self.epoch += 1
            self.batches_consumed = 0
            self.end_of_epoch = False


    def _next(self, source: Iterator[Any]) -> Any:
        """The next batch, or ``_EXHAUSTED``. Where the ranks' streams may end apart, the pass goes on while
        any rank has a batch, a rank whose stream ended reading its first batch again (real samples: 0),
        so that no rank waits alone in a collective and every sample is read."""
        self.stream_position.before_read(self.epoch, self._read)
        upcoming = next(source, _EXHAUSTED)
        self._read += 1
        if self._agreement is None:
            return upcoming
        if upcoming is not _EXHAUSTED and self._first is None:
            self._first = upcoming
        if upcoming is not _EXHAUSTED:
            mine = (_batch_len(upcoming), _batch_len(upcoming))
        else:
            mine = (0, 0 if self._first is None else _batch_len(self._first))
        counts = self._agreement.every_process_count(mine)
        self._counts = [*self._counts[-1:], counts]
        if not any(real for real, _ in counts):
            return _EXHAUSTED
        if upcoming is _EXHAUSTED:
            if self._first is None:
                raise RuntimeError(
                    f"{_name(self.loader)}: this rank's part of the stream is empty while other ranks' are not; "
                    "give the dataset at least one shard per process with samples, or pass it unsharded")
            return self._first
        return upcoming


_EXHAUSTED = object()


def _batch_len(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (else its length)."""
    found: list[int] = []

    def first(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() and not found:
            found.append(int(x.shape[0]))
        return x

    map_leaves(batch, first)
    return found[0] if found else len(batch)


class _SkipFirst:
    """``ShardedDataLoader.skip_first_batches``: one pass that starts at a given batch."""

    def __init__(self, loader: ShardedDataLoader, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = int(num_batches)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.num_batches)

    @property
    def skip_batches(self) -> int:
        """The batches this pass skips."""
        return self.num_batches

    def __iter__(self) -> Iterator[Any]:
        self.loader.resume_at(self.num_batches)
        return iter(self.loader)

    if not TYPE_CHECKING:  # the loader's other members at run time; the type checker sees only the above
        def __getattr__(self, name: str) -> Any:
            return getattr(self.__dict__["loader"], name)


def skip_first_batches(loader: Any, num_batches: int) -> Any:
    """``loader`` from batch ``num_batches`` on: a prepared loader resumes there; any other
    iterable skips that many batches of its next pass."""
    if isinstance(loader, ShardedDataLoader):
        return loader.skip_first_batches(num_batches)
    return itertools.islice(loader, int(num_batches), None)


def fork_may_deadlock(loader: DataLoader) -> bool:
    """True where starting ``loader``'s workers can deadlock one of them: CPython before 3.11.10 (3.12 is fixed)
    forks them while the job's other threads run (the collective monitor, store calls, tqdm's), and a child that
    inherits the interpreter's thread-list lock taken waits for it forever in ``PyOS_AfterFork_Child``
    (CPython gh-112275; measured here: 2 hung workers in 164 resumed runs under load on 3.11.7)."""
    if loader.num_workers == 0 or sys.version_info >= (3, 11, 10):
        return False
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method()
    return method == "fork"


def _name(loader: DataLoader) -> str:
    return f"the DataLoader over {type(loader.dataset).__name__}"


def shard_data_loader(
    loader: DataLoader,
    device: torch.device,
    num_replicas: int = 1,
    rank: int = 0,
    seed: int | None = 0,
    wrap: Callable[[Any], Any] = lambda x: x,
    shard: bool = True,
    split_batches: bool = False,
    non_blocking: bool | None = None,
    pad_to_multiple_of: int | None = None,
    agreement: LoaderAgreement | None = None,
    pass_order: PassOrder | None = None,
) -> ShardedDataLoader:
    """This rank's share of ``loader``, with device placement and a position (``ShardedDataLoader``).

    A map-style loader (any ``sampler``, any ``batch_sampler``) gives rank ``r`` the ``r``-th of every
    ``num_replicas`` batches one process would draw (``xshard.runtime.batch_order``; ``seed`` seeds a plain
    ``shuffle=True`` as Accelerate's seedable sampler, None draws it as Accelerate's default loader;
    generators take rank 0's state from ``agreement``, the job's ``LoaderAgreement``). A stream is split by node
    or sliced per global batch (``xshard.runtime.stream_shard``; a stream whose ranks may end apart asks
    ``agreement`` for every rank's (real samples, samples) in its next batch, an all-gather). Without
    ``agreement`` the loader is a process's own: generators keep their state, a stream's ranks end apart.
    ``loader.batch_size`` is per rank; with ``split_batches`` it is the global batch, each rank taking its slice. ``wrap`` is the backend's ``wrap_dataloader`` (XLA's
    MpDeviceLoader). ``shard=False`` only places batches (for a loader the caller already sharded).
    ``pad_to_multiple_of``: token batches are padded to a multiple of this width (``xshard.static_shapes``).
    ``pass_order``: the job's numbering of its loaders' passes (``JobState.loader_passes``; default: this
    loader's own).
    """
    if not shard:  # the caller's share: its position is its own (counted as a world of one)
        return ShardedDataLoader(loader, device, None, wrap, non_blocking, pass_order=pass_order)
    if num_replicas == 1 and isinstance(loader.dataset, IterableDataset):  # the whole stream, in its order
        return ShardedDataLoader(loader, device, None, wrap, non_blocking, split_batches=split_batches,
                                 pass_order=pass_order)
    size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    if split_batches and (size is None or size % num_replicas):
        raise ValueError(
            f"split_batches=True: the batch size of {_name(loader)} ({size}) is the global batch and must be a "
            f"multiple of the number of processes ({num_replicas}); change batch_size (or give the batch_sampler "
            "a batch_size attribute) or the process count")
    per_rank = None if size is None else (size // num_replicas if split_batches else size)
    if isinstance(loader.dataset, IterableDataset):
        return _shard_stream(loader, device, num_replicas, rank, wrap, split_batches, non_blocking,
                             pad_to_multiple_of, agreement, per_rank, pass_order)
    try:
        len(loader.batch_sampler)  # type: ignore[arg-type]
    except TypeError:
        sampler = loader.batch_sampler if loader.batch_size is None else loader.sampler
        raise ValueError(
            f"prepare() cannot shard {_name(loader)}: its {type(sampler).__name__} has no length, so the batches "
            "that even out the epoch's end cannot be known; give it __len__, or shard the loader yourself and pass "
            "accelerator.prepare_data_loader(loader, shard=False)") from None
    batches = RankBatches(EpochBatches(loader, seed, (agreement or ALONE).main_process_value, num_replicas), num_replicas, rank, split_batches,
                          length=len(cast(Sized, loader.dataset)) if isinstance(loader.dataset, Sized) else 0)
    rebuilt = _rebuild(loader, loader.dataset, {"batch_sampler": batches}, pad_to_multiple_of)
    return ShardedDataLoader(rebuilt, device, batches, wrap, non_blocking, batch_size=per_rank,
                             num_replicas=num_replicas, split_batches=split_batches, pass_order=pass_order)


def _shard_stream(loader: DataLoader, device: torch.device, num_replicas: int, rank: int,
                  wrap: Callable[[Any], Any], split_batches: bool, non_blocking: bool | None,
                  pad_to_multiple_of: int | None, agreement: LoaderAgreement | None, per_rank: int | None,
                  pass_order: PassOrder | None) -> ShardedDataLoader:
    """A stream's share for this rank (``xshard.runtime.stream_shard``)."""
    if splits_by_node(loader.dataset, num_replicas) and not split_batches:
        mine = split_by_node(loader.dataset, rank, num_replicas)
        rebuilt = _rebuild(loader, mine, {"batch_size": loader.batch_size, "drop_last": loader.drop_last},
                           pad_to_multiple_of)
        return ShardedDataLoader(rebuilt, device, None, wrap, non_blocking, agreement=agreement,
                                 num_replicas=num_replicas, pass_order=pass_order)
    if per_rank is None:
        raise ValueError(
            f"prepare() cannot shard {_name(loader)}: a stream is cut per global batch, and this DataLoader does not "
            "batch it (batch_size=None); let the dataset yield samples and set batch_size=..., or shard the stream "
            "yourself (read RANK and WORLD_SIZE) and pass accelerator.prepare_data_loader(loader, shard=False)")
    stream = StreamShard(loader.dataset, per_rank, num_replicas, rank, loader.drop_last)
    rebuilt = _rebuild(loader, stream, {"batch_size": per_rank, "drop_last": loader.drop_last}, pad_to_multiple_of)
    return ShardedDataLoader(rebuilt, device, None, wrap, non_blocking, batch_size=per_rank, stream=stream,
                             num_replicas=num_replicas, split_batches=split_batches, pass_order=pass_order)
