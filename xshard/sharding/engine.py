"""The engine interface: what drives a model's parameters and gradients through forward and backward.

Two implementations, chosen by the plan (``make_engine``):
- ``ReplicatedEngine`` (``replicate.py``): parameters stay whole on every rank; gradients are
  averaged by bucketed all-reduce as backward produces them (stage 0, like DDP);
- ``ShardedEngine`` (``shard_engine.py``): parameters are dim-0 shards gathered unit by unit for
  forward and backward; gradients are reduce-scattered (stages 1-3, like FSDP).

``ShardedModel`` talks to either through this interface only.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


class Engine(ABC):
    """Hooks a model's forward and backward; reduces gradients; knows what it holds."""

    def __init__(self) -> None:
        #: False inside ``no_sync()``: gradients accumulate locally, nothing is reduced
        self.sync = True
        #: all-gathers issued ahead of need, and the most units held at once (sharded engines)
        self.prefetched = 0
        self.peak_in_flight = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) until the first backward after the block."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def reset_counters(self) -> None:
        """Zero the prefetch counters."""
        self.prefetched = self.peak_in_flight = 0

    @abstractmethod
    def remove_hooks(self) -> None:
        """Detach from the model (idempotent)."""

    @abstractmethod
    def shards_changed(self) -> None:
        """The shards were written where the version counters cannot tell (an optimizer step, a load):
        gather again before the next use."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget gradients held between micro-steps (outside the user's ``param.grad``)."""

    @abstractmethod
    def full_params_context(self) -> contextlib.AbstractContextManager[Any]:
        """A block in which every parameter of the model is whole on this rank (see ``summon_full_params``)."""
