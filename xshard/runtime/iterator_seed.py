"""The RNG draw that starts each pass over a torch ``DataLoader``, replayed when a pass resumes an epoch.

Every ``iter(DataLoader)`` draws a base seed (the workers' seeds are ``base_seed + worker_id``) from the
loader's ``generator``, or from torch's global RNG when it has none. In a loop that is not interrupted that
draw happens once per epoch, when the epoch starts (once per run with persistent workers). A pass that
continues an epoch (after a ``break``, or after ``load_state`` restored a position mid-epoch) must not
draw again: the global RNG would move on by one draw, and every dropout mask after it would differ from
the uninterrupted run's. ``IteratorSeed`` records the generator state each fresh draw started from; a
continuing pass gets a private generator in that state for its draw, so its workers get the epoch's seeds
and the global RNG is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch.utils.data import DataLoader


class IteratorSeed:
    """Records and replays the base-seed draw of ``loader``'s passes (see the module docstring)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        #: the state of the generator the current epoch's base seed was drawn from (None: no draw yet)
        self.state: torch.Tensor | None = None

    def _persistent(self) -> bool:
        return bool(self.loader.persistent_workers and self.loader.num_workers > 0)

    def _creates_iterator(self) -> bool:
        # A persistent-workers loader makes its iterator once and then only resets it (no new draw).
        return not (self._persistent() and getattr(self.loader, "_iterator", None) is not None)

    @contextmanager
    def drawing(self, starts_epoch: bool) -> Iterator[None]:
        """Around ``iter(loader)``: a pass that starts an epoch draws as torch does (and its generator's
        state is recorded); a pass that continues one draws from a copy of the recorded state."""
        if not self._creates_iterator():
            yield
            return
        own = self.loader.generator
        if self.state is None or (starts_epoch and not self._persistent()):  # a fresh draw
            self.state = (own if own is not None else torch.default_generator).get_state()
            yield
            return
        replay = torch.Generator()
        replay.set_state(self.state)
        self.loader.generator = replay
        try:
            yield
        finally:
            self.loader.generator = own

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"iterator_seed_state": ...}`` once a pass has drawn, else empty."""
        return {} if self.state is None else {"iterator_seed_state": self.state.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor] | None) -> None:
        """Replay ``state``'s draw on the next pass that continues an epoch (none recorded: draw afresh)."""
        seed_state = (state or {}).get("iterator_seed_state")
        self.state = None if seed_state is None else seed_state.clone()
