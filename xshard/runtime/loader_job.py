"""What a prepared data loader asks of the job it belongs to, handed down when it is prepared.

- ``LoaderAgreement``: what the ranks' loaders must agree on, asked of the job's collectives: rank 0's
  generator state (the order a shuffle draws, ``xshard.runtime.batch_order``) and every rank's batch counts
  (a stream whose ranks may end apart, ``ShardedDataLoader._next``). ``JobState.loader_agreement`` builds it
  from the backend's collectives; ``ALONE`` is a process's own loader, outside any job.
- ``PassOrder``: numbers the passes of the job's loaders, so the job knows which loader is in use (the one
  whose pass started last: nested loops); the ``JobState`` holds one, so two jobs of a process (two
  Accelerators, a test's loaders) never share the count.

Design note: the loader asks these objects rather than callbacks of the Accelerator, so the data code
depends on the job's collectives (``xshard.backends``) alone and is built the same way by any caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..backends.collectives import Collectives


class LoaderAgreement:
    """The collectives a prepared loader needs, over the job's ``world_size`` processes.

    ``collectives`` is the job's (``Backend.collectives``); None is a world of one, which needs none.
    Tensors travel on ``device`` (the job's: the collectives' device), and come back where they were.
    """

    def __init__(self, collectives: Collectives | None, device: torch.device, world_size: int = 1) -> None:
        if collectives is None and world_size > 1:
            raise ValueError(f"LoaderAgreement: a world of {world_size} processes needs the job's collectives")
        self.collectives = collectives
        self.device = device
        self.world_size = world_size

    def main_process_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (same shape and dtype everywhere), where ``tensor`` is."""
        if self.collectives is None or self.world_size == 1:
            return tensor
        on_device = tensor.to(self.device)
        self.collectives.broadcast(on_device, src=0)
        return on_device.to(tensor.device)

    def every_process_count(self, counts: tuple[int, int]) -> list[tuple[int, int]]:
        """Every process's pair of ``counts``, in rank order (one small all-gather)."""
        if self.collectives is None or self.world_size == 1:
            return [counts]
        mine = torch.tensor(counts, dtype=torch.int64, device=self.device)
        out = torch.empty(2 * self.world_size, dtype=torch.int64, device=self.device)
        self.collectives.all_gather_into_tensor(out, mine)
        values = [int(v) for v in out.tolist()]
        return [(values[2 * r], values[2 * r + 1]) for r in range(self.world_size)]


#: a loader of one process, outside any job: nothing to agree on
ALONE = LoaderAgreement(None, torch.device("cpu"))


class PassOrder:
    """Numbers passes over a job's loaders: each pass gets a number higher than every earlier one."""

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        """The number of a pass starting now."""
        self.last += 1
        return self.last
