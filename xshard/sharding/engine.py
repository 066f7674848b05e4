"""The engine interface: what drives a model's parameters and gradients through forward and backward.

Two implementations; ``ShardedModel`` picks one from its plan (``plan.shard_parameters``):
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
        #: does the coming backward reduce? False inside ``no_sync()``, and after it for a backward
        #: whose forward ran inside it (DDP decides at forward time too)
        self.sync = True
        self._in_no_sync = False
        self._forwards = 0
        #: all-gathers issued ahead of need, and the most units held at once (sharded engines)
        self.prefetched = 0
        self.peak_in_flight = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication): backward passes in the block, and backward
        passes after it of forwards run in it, as DDP's ``no_sync``; the first synced backward after
        that reduces everything accumulated."""
        old_sync, old_inside, forwards = self.sync, self._in_no_sync, self._forwards
        self.sync, self._in_no_sync = False, True
        try:
            yield
        finally:
            self._in_no_sync = old_inside
            if self._forwards == forwards:  # no forward in the block: nothing waits to be backwarded unsynced
                self.sync = old_sync

    def forward_started(self) -> None:
        """A forward of the model begins: its backward reduces unless it runs inside ``no_sync``."""
        self._forwards += 1
        self.sync = not self._in_no_sync

    @contextlib.contextmanager
    def trigger_sync_in_backward(self) -> Iterator[None]:
        """Backward passes in the block reduce, even of forwards run inside ``no_sync`` (Accelerate's
        ``trigger_sync_in_backward``: several forwards accumulated, the last backward synchronises)."""
        old, self.sync = self.sync, True
        try:
            yield
        finally:
            self.sync = old

    def reset_counters(self) -> None:
        """Zero the prefetch counters."""
        self.prefetched = self.peak_in_flight = 0

    def units_passed(self) -> int:
        """Units whose collectives this rank took part in without running them (ranks on different paths:
        ``canonical.py``), since the counters were zeroed."""
        return 0

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
    def full_params_context(self, writeback: bool = False) -> contextlib.AbstractContextManager[Any]:
        """A block in which every parameter of the model is whole on this rank (see ``summon_full_params``);
        ``writeback``: changes made to them in the block reach the shards."""
