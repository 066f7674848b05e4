"""Buffers as DDP keeps them: rank 0's buffers are broadcast before each training forward.

BatchNorm running statistics (and any buffer a forward updates) would otherwise drift apart, one
set per rank. DDP's default (``broadcast_buffers=True``) broadcasts rank 0's module buffers at the
start of a forward when the previous forward could be followed by a synchronising backward (grad
enabled, not inside ``no_sync``; also the first forward): so the first evaluation forward after
training still starts from rank 0's buffers, and later ones use each rank's as they are. The same
here, at every stage: buffers are replicated (never sharded), packed into one broadcast per dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # types only: the core imports nothing of the device layer at run time
    from xshard.backends import Collectives


class BufferSync:
    """A forward pre-hook on the root module that broadcasts rank 0's buffers (see the module docstring)."""

    def __init__(self, module: nn.Module, collectives: Collectives, syncing: Callable[[], bool],
                 alone: Callable[[], bool]) -> None:
        self.module = module
        self.collectives = collectives
        self.syncing = syncing  # False inside no_sync()
        self.alone = alone  # True where one rank may run the model by itself (summon_full_params)
        self._handle = None
        self._sync_next = True  # decided by the previous forward, as DDP's require_forward_param_sync
        if collectives.world_size > 1 and any(True for _ in module.buffers()):
            self._handle = module.register_forward_pre_hook(self._pre_forward)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: object) -> None:
        if self.alone():
            return
        if self._sync_next:
            self.broadcast()
        self._sync_next = torch.is_grad_enabled() and self.syncing()

    def broadcast(self) -> None:
        """Every rank's buffers become rank 0's (one broadcast per dtype and device)."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buf in dict.fromkeys(self.module.buffers()):
            if buf.numel():
                groups.setdefault((buf.dtype, buf.device), []).append(buf)
        with torch.no_grad():
            for (dtype, _), bufs in groups.items():
                flat = torch.cat([b.reshape(-1) for b in bufs])
                self.collectives.broadcast(flat, src=0, tag=f"broadcast of {dtype} buffers")
                offset = 0
                for b in bufs:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
