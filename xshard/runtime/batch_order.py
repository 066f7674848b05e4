"""Which batches each rank reads: the batches one process would draw, dealt out as Accelerate deals them.

``EpochBatches`` gives, for each epoch, the batches a single process would draw from the user's loader:
its ``batch_sampler`` (a custom one, or the ``BatchSampler`` that ``batch_size=`` builds over any
``sampler``). Where the order is random it is made the same on every rank:

- a plain ``RandomSampler`` (``shuffle=True`` without a generator) draws from a private generator seeded
  with ``seed + epoch``: Accelerate's ``SeedableRandomSampler`` order, the stock Trainer's order;
- a sampler or batch sampler with its own ``torch.Generator`` (a seeded ``WeightedRandomSampler``,
  transformers' ``LengthGroupedSampler``, ``shuffle=True, generator=g``) draws from it, the generator first
  given rank 0's state each epoch (as Accelerate synchronises it); the state an epoch started from is
  checkpointed, so a resumed run draws the same epoch again;
- any other sampler is iterated as it is, ``set_epoch(epoch)`` first where it has one.

A sampler that already draws one rank's share (a ``DistributedSampler`` the script built, transformers'
``BatchRebalanceSampler``: its ``num_replicas`` or ``dp_size`` and its ``rank`` are this job's) is read
whole by its rank, not dealt out again: sharded twice, each rank would read a ``W``-th of its share
(Accelerate's ``BatchSamplerShard`` does that to a ``DistributedSampler``; the stock Trainer switches it off
for its ``BatchRebalanceSampler``). One built for another world is an error naming both worlds.

``RankBatches`` is rank ``r``'s batch sampler: of every ``W`` consecutive batches it takes the ``r``-th
(with ``split_batches``: its ``r``-th slice of every batch). The last batches are evened out as
Accelerate's ``even_batches=True`` does: a short round is completed with samples from the start of the
epoch, so every rank reads the same number of batches; ``real`` records, per batch, how many of each
rank's samples are real (``gather_for_metrics`` drops the others).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

Agree = Callable[[torch.Tensor], torch.Tensor]


def _share_of(obj: Any) -> tuple[int, int] | None:
    """(world, rank) of a sampler that draws one rank's share itself; None for one that draws for one process."""
    world = getattr(obj, "num_replicas", None)
    world = getattr(obj, "dp_size", None) if world is None else world
    rank = getattr(obj, "rank", None)
    if isinstance(world, int) and isinstance(rank, int) and world > 1:
        return world, rank
    return None


def _generator_of(obj: Any) -> torch.Generator | None:
    found = getattr(obj, "generator", None)
    return found if isinstance(found, torch.Generator) else None


class EpochBatches:
    """One process's batches of each epoch of ``loader`` (see the module docstring).

    ``seed``: the seed of a plain ``shuffle=True``. ``agree``: rank 0's value of a tensor (a broadcast),
    for the generators that draw an order.
    """

    def __init__(self, loader: DataLoader, seed: int, agree: Agree) -> None:
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:
            raise ValueError("EpochBatches needs a map-style DataLoader (one with a batch sampler)")
        self.batch_sampler: Any = batch_sampler
        self.sampler: Any = getattr(batch_sampler, "sampler", None)
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.seed = int(seed)
        self.agree = agree
        self.seeded = (type(self.sampler) is RandomSampler and self.sampler.generator is None
                       and isinstance(batch_sampler, BatchSampler))
        self.generator = None if self.seeded else (_generator_of(batch_sampler) or _generator_of(self.sampler))
        self.drawn_epoch: int | None = None  # the epoch whose draw started from ``start_state``
        self.start_state: torch.Tensor | None = None
        self.restored_state: torch.Tensor | None = None
        #: (world, rank) the sampler draws one rank's share for, when it does (see the module docstring)
        self.share = _share_of(batch_sampler) or _share_of(self.sampler)

    def __len__(self) -> int:
        """Batches one process draws per epoch."""
        return len(self.batch_sampler)

    def _set_epoch(self, epoch: int) -> None:
        for owner in (self.batch_sampler, self.sampler):
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
                return

    def batches(self, epoch: int) -> Iterator[list[int]]:
        """Epoch ``epoch``'s batches, drawn lazily (as the loader draws them). Drawing the same epoch again
        (a pass that continues it) gives the same batches."""
        if self.seeded:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            shuffled = RandomSampler(self.sampler.data_source, replacement=self.sampler.replacement,
                                     num_samples=self.sampler._num_samples, generator=g)
            return iter(BatchSampler(shuffled, self.batch_size or 1, self.drop_last))
        if self.generator is not None:
            if self.restored_state is not None:
                self.generator.set_state(self.restored_state)
                self.restored_state = None
            elif epoch == self.drawn_epoch and self.start_state is not None:
                self.generator.set_state(self.start_state)
            else:
                self.generator.set_state(self.agree(self.generator.get_state()))
            self.start_state, self.drawn_epoch = self.generator.get_state(), epoch
        self._set_epoch(epoch)
        return iter(self.batch_sampler)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The generator state the current epoch was drawn from (empty when there is none)."""
        return {} if self.start_state is None else {"generator_state": self.start_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Draw the restored epoch again from the saved generator state."""
        if "generator_state" in state and self.generator is not None:
            self.restored_state = state["generator_state"]


class RankBatches(Sampler[list[int]]):
    """Rank ``rank`` of ``num_replicas``: its batches of each epoch (a batch sampler for a DataLoader).

    ``start``: batches of the epoch to skip (a resume). ``real[k]``: for the epoch's batch ``k``, how many
    samples of each rank's batch ``k`` are real, not repeats that even out the end.
    """

    def __init__(self, source: EpochBatches, num_replicas: int, rank: int, split_batches: bool = False,
                 length: int = 0) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"RankBatches: rank {rank} is not in a world of {num_replicas}")
        if source.share is not None and source.share != (num_replicas, rank):
            owner = source.sampler if _share_of(source.sampler) else source.batch_sampler
            raise ValueError(
                f"the DataLoader's {type(owner).__name__} draws the share of rank {source.share[1]} of "
                f"{source.share[0]} processes, but this is rank {rank} of {num_replicas}; build it with "
                f"num_replicas={num_replicas}, rank={rank} (or let prepare() shard a sampler that draws for one process)")
        self.source = source
        self.num_replicas = num_replicas
        self.rank = rank
        self.split_batches = split_batches
        self.epoch = 0
        self.start = 0
        self.length = length  # samples in the dataset
        #: per batch of the epoch: (each rank's real samples in it, this rank's samples in it)
        self.real: dict[int, tuple[list[int], int]] = {}

    @property
    def seed(self) -> int:
        """The seed of a plain shuffle (its order is ``seed + epoch``)."""
        return self.source.seed

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s batches."""
        self.epoch = int(epoch)

    def total(self) -> int:
        """Batches per rank in a whole epoch."""
        n, w = len(self.source), self.num_replicas
        if self.source.share is not None:  # the sampler's own batches are this rank's
            return n
        if w == 1 or self.split_batches or n % w == 0 or self.source.drop_last:
            return n if self.split_batches else n // w
        return n // w + 1

    def __len__(self) -> int:
        return max(0, self.total() - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        self.real = {}
        batches = self.source.batches(self.epoch)
        if self.source.share is not None:  # the sampler drew this rank's share: its batches, all real (as
            # the other ranks' sizes are not known here, ``real`` stays empty: gather_for_metrics keeps every row)
            for k, batch in enumerate(batches):
                if k >= self.start:
                    yield list(batch)
            return
        if self.num_replicas == 1:  # one process reads the loader's own batches (a short last one stays short)
            rounds: Iterator[list[tuple[list[int], int]]] = ([(list(b), len(b))] for b in batches)
        else:
            rounds = self._split(batches) if self.split_batches else self._whole(batches)
        for k, dealt in enumerate(rounds):
            if k >= self.start:
                mine = dealt[self.rank][0]
                self.real[k] = ([count for _, count in dealt], len(mine))
                yield mine

    # Each round is every rank's (batch, real samples in it), in rank order.
    def _whole(self, batches: Iterator[list[int]]) -> Iterator[list[tuple[list[int], int]]]:
        w, size = self.num_replicas, self.source.batch_size
        first: list[int] = []  # the samples of the epoch's first round, to complete the last one
        first_batches: list[list[int]] = []
        pending: list[list[int]] = []
        for batch in batches:
            if len(first_batches) < w:
                first_batches.append(list(batch))
                first.extend(batch)
            pending.append(list(batch))
            if len(pending) == w and (size is None or len(batch) == size):
                yield [(b, len(b)) for b in pending]
                pending = []
        if not pending or self.source.drop_last:
            return
        if size is None:  # whole batches of the epoch's start for the ranks that have none
            fill = [(first_batches[i % len(first_batches)], 0) for i in range(w - len(pending))]
            yield [(b, len(b)) for b in pending] + fill
            return
        while len(first) < w * size:
            first = first + first
        out: list[tuple[list[int], int]] = []
        used = 0
        for i in range(w):
            own = pending[i] if i < len(pending) else []
            need = size - len(own)
            out.append((own + first[used:used + need], len(own)))
            used += need
        yield out

    def _split(self, batches: Iterator[list[int]]) -> Iterator[list[tuple[list[int], int]]]:
        w, size = self.num_replicas, self.source.batch_size or 1
        part = size // w
        first: list[int] = []
        for batch in batches:
            if not first:
                first = list(batch)
            filled, real = list(batch), len(batch)
            if real < size:
                if self.source.drop_last:
                    return
                while len(filled) < size:
                    filled = filled + first
            yield [(filled[r * part:(r + 1) * part], min(part, max(0, real - r * part))) for r in range(w)]
