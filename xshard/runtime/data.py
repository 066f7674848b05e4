"""Data loading for data-parallel jobs: one disjoint slice per rank, batches on the right device.

``ShardSampler`` gives rank ``r`` of ``W`` the indices ``order[r::W]`` of a per-epoch order (a seeded
shuffle, the order the loader's own sampler draws when it brings its own randomness, or 0..n-1; see
``DrawnOrder``). Interleaving matters: batch ``k`` of every rank together is exactly batch ``k`` of
a single process whose batch size is ``W`` times larger, so a sharded run can be checked against a
single-process run on the full batch.

``ShardedDataLoader`` wraps a rebuilt ``torch.utils.data.DataLoader`` (same dataset, batch size per
rank, collate function, workers) and adds what training needs:

- batches moved to the device (tensors inside dicts, lists, tuples, named tuples, HF ``BatchEncoding``);
- the epoch advances by itself at the end of each pass (``set_epoch`` still works), so each epoch
  has a new shuffle without user code;
- the position (epoch and batches consumed) is remembered: ``state_dict()`` / ``load_state_dict()``
  resume mid-epoch without reading the skipped samples again;
- the RNG draw each pass makes (the workers' base seed, from torch's global RNG when the loader has no
  generator) happens once per epoch, as in a loop that is not interrupted: a pass that continues an
  epoch replays the epoch's draw (``IteratorSeed``), so a resumed run's dropout masks and workers' seeds
  are the uninterrupted run's;
- ``end_of_epoch`` is True while the last batch of an epoch is being used (the Accelerator syncs
  gradients there even when the accumulation window is not full);
- ``real_counts()`` says, for the batch in use, how many of each rank's samples are real rather
  than the wrap-around repeats that even out the last batch (``gather_for_metrics`` drops those).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from ..sharding.trees import map_leaves
from .iterator_seed import IteratorSeed
from .rank_logging import get_logger

log = get_logger("xshard.runtime.data")


class DrawnOrder:
    """Each epoch's order drawn from the user's own shuffling sampler, as one process would draw it.

    Used for a ``RandomSampler`` that brings its own randomness: a ``generator``
    (``DataLoader(shuffle=True, generator=g)``) or an epoch-seeded sampler with ``set_epoch``
    (Accelerate's ``SeedableRandomSampler``). A script that seeds ``g`` expects the order to follow
    ``g``: the union of the ranks' batches is then the batch a single process draws with the same
    generator (Accelerate's ``training_check`` asserts this). Before each epoch's draw the generator
    takes rank 0's state (``agree``), as Accelerate synchronises it, so ranks seeded apart still
    split one order. The state the draw started from is checkpointed (``state_dict``), so a resumed
    run draws the same order for its epoch again.

    A ``RandomSampler`` without a generator keeps xshard's seeded shuffle (``seed + epoch``): its
    single-process order would come from the global RNG, which ranks do not share and a resume
    cannot replay.
    """

    def __init__(self, sampler: RandomSampler, agree: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.sampler = sampler
        self.agree = agree
        self.epoch: int | None = None  # the epoch whose order is cached
        self.order: list[int] = []
        self.start_state: torch.Tensor | None = None  # the generator's state before that epoch's draw
        self.restored_state: torch.Tensor | None = None  # from a checkpoint, for the next draw

    @staticmethod
    def applies_to(sampler: Sampler[int]) -> TypeGuard[RandomSampler]:
        """True for a ``RandomSampler`` with its own generator or its own ``set_epoch``."""
        return isinstance(sampler, RandomSampler) and (
            sampler.generator is not None or callable(getattr(sampler, "set_epoch", None)))

    def order_of(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order over the dataset (drawn once per epoch, the same on every rank)."""
        if epoch != self.epoch:
            generator = self.sampler.generator
            if generator is not None:
                if self.restored_state is not None:
                    generator.set_state(self.restored_state)
                    self.restored_state = None
                else:
                    generator.set_state(self.agree(generator.get_state()))
                self.start_state = generator.get_state()
            set_epoch = getattr(self.sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            self.order, self.epoch = list(iter(self.sampler)), epoch
        return self.order

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The generator state this epoch's order was drawn from (empty before any draw)."""
        return {} if self.start_state is None else {"generator_state": self.start_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Draw the restored epoch's order again from the saved generator state."""
        if "generator_state" in state:
            self.restored_state = state["generator_state"]
            self.epoch = None


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
        drawn: each epoch's order drawn from the user's sampler instead (``DrawnOrder``).
    """

    def __init__(
        self, length: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = False, seed: int = 0,
        drop_last: bool = False, drawn: DrawnOrder | None = None,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ShardSampler: rank {rank} is not in a world of {num_replicas}")
        self.length = int(length)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.drawn = drawn
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
        if self.drawn is not None:
            order = list(self.drawn.order_of(self.epoch))
        elif self.shuffle:
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


def _rebuild(loader: DataLoader, sampler: Sampler[int], batch_size: int | None = None,
             pad_to_multiple_of: int | None = None) -> DataLoader:
    """The same DataLoader with ``sampler`` in place of its own (every other setting kept but the
    batch size, when one is given, and the collate function, wrapped to pad token batches to a
    multiple of ``pad_to_multiple_of`` when one is given: ``xshard.static_shapes``)."""
    collate_fn = loader.collate_fn
    if pad_to_multiple_of:
        from ..static_shapes import PadToMultiple

        if not isinstance(collate_fn, PadToMultiple):  # the user's own hook (tensors named) is kept
            collate_fn = PadToMultiple(collate_fn, pad_to_multiple_of)
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size if batch_size is None else batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    return DataLoader(loader.dataset, **kwargs)


class ShardedDataLoader:
    """A DataLoader that shards over ranks, places batches on the device and remembers its position.

    Build it with ``shard_data_loader`` (``Accelerator.prepare`` does). Iterating it gives this
    rank's batches of the current epoch, starting after the batches already consumed.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        sampler: ShardSampler | None,
        wrap: Callable[[Any], Any] = lambda x: x,
        non_blocking: bool | None = None,
    ) -> None:
        self.loader = loader
        self.device = device
        self.sampler = sampler
        self._wrap = wrap
        self._non_blocking = non_blocking
        self.epoch = 0
        self.batches_consumed = 0
        self.end_of_epoch = False
        #: True between the first and the last batch of a pass; ``iteration_order`` orders the
        #: passes of all loaders, so the one started last is the one being used (nested loops)
        self.in_iteration = False
        self.iteration_order = 0
        #: this rank's record of the epoch's base-seed draw (checkpointed with the rank's RNG states)
        self.iterator_seed = IteratorSeed(loader)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        """Batch size per rank (the global batch is this times the world size)."""
        return self.loader.batch_size

    def __len__(self) -> int:
        """Batches per rank in a whole epoch."""
        if self.sampler is None:
            return len(self.loader)
        n, b = self.sampler.num_samples, self.loader.batch_size or 1
        return n // b if self.loader.drop_last else math.ceil(n / b)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a different shuffle). Setting the current epoch again keeps the
        position, so ``set_epoch`` in a loop after ``load_state_dict`` resumes mid-epoch."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.batches_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: ``{"epoch", "batches_consumed"}`` (the same on every rank), and the
        ``generator_state`` its epoch's order was drawn from when the user's sampler draws it. The
        rank's own record of its epoch's base-seed draw is ``iterator_seed.state_dict()`` (a checkpoint
        keeps it with the rank's RNG states)."""
        state: dict[str, Any] = {"epoch": self.epoch, "batches_consumed": self.batches_consumed}
        if self.sampler is not None and self.sampler.drawn is not None:
            state.update(self.sampler.drawn.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``: the next pass starts after ``batches_consumed`` batches of ``epoch``."""
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])
        if self.sampler is not None and self.sampler.drawn is not None:
            self.sampler.drawn.load_state_dict(state)
        if self.sampler is not None and 0 < len(self) <= self.batches_consumed:
            # Saved on the epoch's last batch: the next pass is the next epoch, as it is uninterrupted (and
            # as a loop that counts its epoch and skip from the step, ``divmod(step, len(loader))``, expects).
            if self.sampler.drawn is not None:
                self.sampler.drawn.order_of(self.epoch)  # the generator moves on past this epoch's draw
            self.epoch, self.batches_consumed = self.epoch + 1, 0

    def real_counts(self) -> tuple[list[int], int] | None:
        """(per rank, the real samples of the batch in use; the batch's samples per rank): the others
        repeat samples to even out the last batch. None when the loader is not sharded by index."""
        if self.sampler is None or not self.in_iteration or self.batches_consumed == 0:
            return None
        size = self.loader.batch_size or 1
        start = (self.batches_consumed - 1) * size
        end = min(start + size, self.sampler.num_samples)
        return [self.sampler.real_count(r, start, end) for r in range(self.sampler.num_replicas)], end - start

    def skip_first_batches(self, num_batches: int) -> _SkipFirst:
        """Iterate the current epoch from batch ``num_batches`` (counted from the epoch's start).

        The position is absolute, so skipping to where ``load_state`` already resumed skips nothing
        more.
        """
        return _SkipFirst(self, num_batches)

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = self.batches_consumed * (self.loader.batch_size or 1)
        self.end_of_epoch = False
        with self.iterator_seed.drawing(starts_epoch=self.batches_consumed == 0):
            source = iter(self._wrap(self.loader))
        non_blocking = bool(self.loader.pin_memory) if self._non_blocking is None else self._non_blocking
        global _ITERATIONS
        _ITERATIONS += 1
        self.iteration_order = _ITERATIONS
        # Look one batch ahead so the last batch is known while it is in use.
        try:
            upcoming = next(source)
        except StopIteration:
            upcoming = _EXHAUSTED
        self.in_iteration = upcoming is not _EXHAUSTED
        try:
            while upcoming is not _EXHAUSTED:
                current = upcoming
                try:
                    upcoming = next(source)
                except StopIteration:
                    upcoming = _EXHAUSTED
                    self.end_of_epoch = True
                self.batches_consumed += 1
                yield move_to_device(current, self.device, non_blocking)
        finally:  # also when the loop breaks out early
            self.in_iteration = False
        self.epoch += 1
        self.batches_consumed = 0
        self.end_of_epoch = False


_EXHAUSTED = object()
_ITERATIONS = 0


class _SkipFirst:
    """``ShardedDataLoader.skip_first_batches``: one pass that starts at a given batch."""

    def __init__(self, loader: ShardedDataLoader, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = int(num_batches)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.num_batches)

    def __iter__(self) -> Iterator[Any]:
        self.loader.batches_consumed = max(self.loader.batches_consumed, self.num_batches)
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


def shard_data_loader(
    loader: DataLoader,
    device: torch.device,
    num_replicas: int = 1,
    rank: int = 0,
    seed: int = 0,
    wrap: Callable[[Any], Any] = lambda x: x,
    shard: bool = True,
    split_batches: bool = False,
    non_blocking: bool | None = None,
    pad_to_multiple_of: int | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> ShardedDataLoader:
    """Give ``loader`` a ``ShardSampler`` for this rank and device placement.

    The sampler shuffles (with ``seed``) when the loader's sampler is a ``RandomSampler`` (i.e.
    ``shuffle=True``) and keeps the dataset order otherwise; a ``RandomSampler`` with its own
    generator (or ``set_epoch``) draws each epoch's order itself, its generator first given rank 0's
    state by ``agree`` (a broadcast from rank 0; ``DrawnOrder``). ``loader.batch_size`` is per rank.
    ``wrap`` is the backend's ``wrap_dataloader`` (XLA's MpDeviceLoader). ``shard=False`` only
    places batches (for a loader the caller already sharded). ``split_batches``: ``batch_size`` is
    the global batch, and each rank takes ``batch_size / num_replicas`` of it (Accelerate's
    ``split_batches``; batch ``k`` of every rank together is batch ``k`` of the whole loader).
    ``pad_to_multiple_of``: token batches are padded to a multiple of this width (static shapes for
    devices that compile graphs; ``xshard.static_shapes``).
    """
    if not shard or isinstance(loader.dataset, IterableDataset):
        if shard and num_replicas > 1:
            log.warning(
                "an IterableDataset cannot be split by index: every rank reads the whole stream unless the "
                "dataset itself reads RANK and WORLD_SIZE and yields only its share"
            )
        return ShardedDataLoader(loader, device, None, wrap, non_blocking)
    if loader.batch_size is None:
        raise ValueError(
            "prepare() cannot shard a DataLoader built with a custom batch_sampler: build it with "
            "batch_size=... (and shuffle=True/False), or shard it yourself and pass it to "
            "accelerator.prepare_data_loader(loader, shard=False)"
        )
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(
            f"prepare() cannot shard a DataLoader whose sampler is {type(loader.sampler).__name__}: only "
            "shuffle=True (RandomSampler) and shuffle=False (SequentialSampler) are re-sampled per rank; "
            "shard it yourself and pass it to accelerator.prepare_data_loader(loader, shard=False)"
        )
    if isinstance(loader.sampler, RandomSampler) and (
        loader.sampler.replacement or loader.sampler.num_samples != len(cast(Sized, loader.dataset))
    ):
        raise ValueError(
            "prepare() cannot shard a RandomSampler with replacement=True or num_samples set: use "
            "shuffle=True, or shard the loader yourself and pass it with shard=False"
        )
    batch_size = loader.batch_size
    if split_batches:
        if batch_size % num_replicas:
            raise ValueError(
                f"split_batches=True: the DataLoader's batch_size ({batch_size}) is the global batch and must be a "
                f"multiple of the number of processes ({num_replicas}); change batch_size or the process count"
            )
        batch_size //= num_replicas
    sampler = ShardSampler(
        len(cast(Sized, loader.dataset)), num_replicas=num_replicas, rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler), seed=seed, drop_last=loader.drop_last,
        drawn=DrawnOrder(loader.sampler, agree) if DrawnOrder.applies_to(loader.sampler) else None,
    )
    return ShardedDataLoader(_rebuild(loader, sampler, batch_size, pad_to_multiple_of), device, sampler, wrap,
                             non_blocking)
