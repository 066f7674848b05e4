"""``SingleProcessCollectives``: world size 1, where every collective is a local copy or nothing."""

from __future__ import annotations

import torch

from .handle import Handle, _finished
from .interface import Collectives


class SingleProcessCollectives(Collectives):
    """World size 1: nothing leaves the process. Bytes are still counted (0 sent in practice,
    but the logical payload is what the accounting compares with theory)."""

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.reshape(output.shape) if input.numel() == output.numel() else input)
        return _finished(output)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.reshape(output.shape))
        return _finished(output)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        return _finished(tensor)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        return _finished(tensor)

    # no packing at world size 1: each pair is a copy at most (through the primitives, which
    # subclasses for devices without data pointers override)
    def _all_gather_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Handle:
        for out, inp in zip(outputs, inputs, strict=True):
            self._all_gather(out.view(-1), inp.reshape(-1))
        return _finished(outputs)

    def _reduce_scatter_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                             op: str) -> Handle:
        for out, inp in zip(outputs, inputs, strict=True):
            self._reduce_scatter(out.view(-1), inp.view(-1), op)
        return _finished(outputs)
