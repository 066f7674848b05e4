"""Which batches each rank reads: the batches one process would draw, dealt out as Accelerate deals them.

``EpochBatches`` gives, for each epoch, the batches a single process would draw from the user's loader:
its ``batch_sampler`` (a custom one, or the ``BatchSampler`` that ``batch_size=`` builds over any
``sampler``). Where the order is random it is made the same on every rank:

- a plain ``RandomSampler`` (``shuffle=True`` without a generator) draws its order as Accelerate's prepared
  loader does, in either of Accelerate's modes (``DataLoaderConfiguration.use_seedable_sampler``):

  - seedable (``seed`` given: Accelerate's ``data_seed``, else ``torch.random.initial_seed()`` when the loader
    is prepared, so a script's ``set_seed`` before ``prepare`` decides it): a private generator seeded with
    ``seed + epoch``, ``SeedableRandomSampler``'s order and the stock Trainer's;
  - Accelerate's default (``seed=None``): on several processes one draw from torch's global RNG when the loader
    is prepared seeds a generator, which every epoch then draws from with rank 0's state (Accelerate's
    ``synchronized_generator``); on one process each pass draws a new seed from the global RNG, as torch's
    ``RandomSampler`` does (Accelerate leaves a one-process loader's sampler as it is);

- a sampler or batch sampler with its own ``torch.Generator`` (a seeded ``WeightedRandomSampler``,
  transformers' ``LengthGroupedSampler``, ``shuffle=True, generator=g``) draws from it, the generator first
  given rank 0's state each epoch (as Accelerate synchronises it);
- any other sampler is iterated as it is, ``set_epoch(epoch)`` first where it has one.

Wherever an order depends on a generator's state, the state an epoch's draw started from is checkpointed
(``state_dict``), so a pass that resumes that epoch draws it again and later epochs follow as uninterrupted.
Every other pass draws afresh, as torch's ``DataLoader`` does at each ``iter()``.

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

    ``seed``: the seed of a plain ``shuffle=True`` (the seedable order); None for Accelerate's default order.
    ``agree``: rank 0's value of a tensor (a broadcast), for the generators that draw an order. ``world``: the
    number of processes (Accelerate's default order differs between one and several).
    """

    def __init__(self, loader: DataLoader, seed: int | None, agree: Agree, world: int = 1) -> None:
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:
            raise ValueError("EpochBatches needs a map-style DataLoader (one with a batch sampler)")
        self.batch_sampler: Any = batch_sampler
        self.sampler: Any = getattr(batch_sampler, "sampler", None)
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.seed = None if seed is None else int(seed)
        self.agree = agree
        #: a plain ``shuffle=True``: the order is drawn here, as Accelerate draws it (module docstring)
        self.plain = (type(self.sampler) is RandomSampler and self.sampler.generator is None
                      and isinstance(batch_sampler, BatchSampler))
        self.seeded = self.plain and self.seed is not None
        #: one process, Accelerate's default: each pass draws its seed from the global RNG (``_start_state``)
        self.per_pass = self.plain and self.seed is None and world == 1
        if self.plain and self.seed is None:
            # Accelerate's default order: on several processes, one draw from the global RNG when the loader is
            # prepared (the same draw, at the same point, as Accelerate's, so the script's later random numbers
            # are Accelerate's too) seeds the generator every epoch draws from; on one process, each pass's own.
            self.generator: torch.Generator | None = torch.Generator()
            if not self.per_pass:
                self.generator.manual_seed(_global_draw())
        else:
            self.generator = None if self.seeded else (_generator_of(batch_sampler) or _generator_of(self.sampler))
        self.drawn_epoch: int | None = None  # the epoch whose draw started from ``start_state``
        self.start_state: torch.Tensor | None = None
        self.restored: tuple[torch.Tensor, int | None] | None = None  # a checkpoint's (state, epoch drawn from it)
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

    def _plain_batches(self, generator: torch.Generator) -> Iterator[list[int]]:
        """The user's ``shuffle=True`` batches, the order drawn from ``generator``."""
        shuffled = RandomSampler(self.sampler.data_source, replacement=self.sampler.replacement,
                                 num_samples=self.sampler._num_samples, generator=generator)
        return iter(BatchSampler(shuffled, self.batch_size or 1, self.drop_last))

    def batches(self, epoch: int, fresh: bool = True) -> Iterator[list[int]]:
        """Epoch ``epoch``'s batches, drawn lazily (as the loader draws them). ``fresh``: a new pass, drawn
        afresh as torch draws each ``iter()``; otherwise a pass that resumes the epoch, which draws the epoch's
        batches again from the state its draw started from."""
        if self.seeded:
            assert self.seed is not None
            return self._plain_batches(torch.Generator().manual_seed(self.seed + epoch))
        if self.generator is not None:
            self.generator.set_state(self._start_state(epoch, fresh))
            self.start_state, self.drawn_epoch = self.generator.get_state(), epoch
            if self.plain:
                return self._plain_batches(self.generator)
        self._set_epoch(epoch)
        return iter(self.batch_sampler)

    def _start_state(self, epoch: int, fresh: bool) -> torch.Tensor:
        """The generator state epoch ``epoch``'s draw starts from."""
        assert self.generator is not None
        if self.restored is not None:
            (state, drawn), self.restored = self.restored, None
            if drawn in (None, epoch):  # the checkpoint's epoch: drawn again
                return state
            if not self.per_pass:  # saved after its epoch ended: the generator moves past that epoch's draw
                self.generator.set_state(state)
                for _ in self.batches(drawn):
                    pass
        elif not fresh and epoch == self.drawn_epoch and self.start_state is not None:
            return self.start_state
        if self.per_pass:  # torch's RandomSampler: a seed from the global RNG, a new generator
            return torch.Generator().manual_seed(_global_draw()).get_state()
        return self.agree(self.generator.get_state())

    def state_dict(self) -> dict[str, Any]:
        """The generator state the current epoch was drawn from and that epoch (empty when there is none)."""
        if self.start_state is None:
            return {}
        return {"generator_state": self.start_state, "generator_epoch": self.drawn_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Draw the restored epoch again from the saved generator state (and later epochs after it)."""
        if "generator_state" in state and self.generator is not None:
            drawn = state.get("generator_epoch")
            self.restored = (state["generator_state"], None if drawn is None else int(drawn))


def _global_draw() -> int:
    """A seed from torch's global RNG, drawn as torch's ``RandomSampler`` and Accelerate draw theirs."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


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
        #: the next pass is a new one (drawn afresh), not one that resumes its epoch (``EpochBatches.batches``)
        self.fresh = True
        self.length = length  # samples in the dataset
        #: per batch of the epoch: (each rank's real samples in it, this rank's samples in it)
        self.real: dict[int, tuple[list[int], int]] = {}

    @property
    def seed(self) -> int | None:
        """The seed of a plain shuffle (its order is ``seed + epoch``); None for Accelerate's default order."""
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
        batches = self.source.batches(self.epoch, self.fresh)
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
