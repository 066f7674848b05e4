"""Collectives: all_gather / reduce_scatter / all_reduce / broadcast / barrier, with a byte counter.

Three implementations share one interface:
- ``DistCollectives``: torch.distributed (gloo, nccl, hccl). Options choose, per operation, the fastest
  way a process group can do the job (gloo's own reduce-scatter and all-gather are slow; see
  ``backends/cpu.py`` and ``benchmarks/collectives_gloo.py``).
- ``SingleProcessCollectives``: world size 1; every call is a local copy or nothing.
- torch_xla's, in ``backends/xla.py``.

Reduce ops are a capability: where the process group has no native AVG (gloo, hccl, xla) the
average is a SUM followed by a divide, done when the handle is waited on.

Byte accounting follows the ZeRO paper's convention so that counts compare with theory
(ZeRO-3 = 3 psi per step, ZeRO-2 and DDP = 2 psi): an all-gather or a reduce-scatter counts the size
of the full (unsharded) tensor, an all-reduce twice the tensor (it is a reduce-scatter plus an
all-gather), a broadcast the tensor once. These are logical payloads, independent of the wire
algorithm, so the same training step counts the same bytes on every backend.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass
class CommCounter:
    """Bytes and calls per collective kind since the last ``reset``."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[kind] += int(nbytes)
            self.calls[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain copy: ``{"bytes": {kind: n}, "calls": {kind: n}}``."""
        with self._lock:
            return {"bytes": dict(self.bytes), "calls": dict(self.calls)}

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Handle:
    """An asynchronous collective in flight. ``wait()`` blocks until it is done and returns its output.

    ``finish`` runs once after the underlying work completes (e.g. the divide of a SUM-then-divide
    average, or the copy of this rank's slice out of an all-reduce).
    """

    __slots__ = ("_works", "_finish", "_output", "_done")

    def __init__(self, works: list, output: torch.Tensor | None, finish: Callable[[], None] | None = None):
        self._works = works
        self._finish = finish
        self._output = output
        self._done = False

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            for w in self._works:
                if w is not None:
                    w.wait()
            if self._finish is not None:
                self._finish()
            self._done = True
        return self._output

    @property
    def done(self) -> bool:
        return self._done


def _finished(output: torch.Tensor | None) -> Handle:
    h = Handle([], output)
    h._done = True
    return h


class Collectives:
    """The interface the sharded core uses. Subclasses implement the ``_``-prefixed primitives."""

    rank: int = 0
    world_size: int = 1

    def __init__(self) -> None:
        self.counter = CommCounter()

    # All public methods return a Handle when async_op=True, else None (the work is done).

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's ``input`` (equal sizes) into ``output`` along dim 0."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements, expected "
                f"{input.numel()} x world size {self.world_size}"
            )
        self.counter.add("all_gather", _nbytes(output))
        return self._result(self._all_gather(output, input), async_op)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "avg", async_op: bool = False
    ):
        """Reduce ``input`` over ranks and keep this rank's equal slice (dim 0) in ``output``.

        ``input`` is scratch: its contents are unspecified afterwards (some implementations reduce
        in place), so pass a buffer that is not needed again.
        """
        _check_op(op)
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
                f"{output.numel()} x world size {self.world_size}"
            )
        self.counter.add("reduce_scatter", _nbytes(input))
        return self._result(self._reduce_scatter(output, input, op), async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "avg", async_op: bool = False):
        """Reduce ``tensor`` in place over all ranks."""
        _check_op(op)
        self.counter.add("all_reduce", 2 * _nbytes(tensor))
        return self._result(self._all_reduce(tensor, op), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        self.counter.add("broadcast", _nbytes(tensor))
        return self._result(self._broadcast(tensor, src), async_op)

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    @staticmethod
    def _result(handle: Handle, async_op: bool) -> Handle | None:
        if async_op:
            return handle
        handle.wait()
        return None

    # primitives: each returns a Handle (possibly already finished)
    def _all_gather(self, output, input) -> Handle:
        raise NotImplementedError

    def _reduce_scatter(self, output, input, op) -> Handle:
        raise NotImplementedError

    def _all_reduce(self, tensor, op) -> Handle:
        raise NotImplementedError

    def _broadcast(self, tensor, src) -> Handle:
        raise NotImplementedError


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of {REDUCE_OPS}")


class SingleProcessCollectives(Collectives):
    """World size 1: nothing leaves the process. Bytes are still counted (0 sent in practice,
    but the logical payload is what the accounting compares with theory)."""

    def _all_gather(self, output, input):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.reshape(output.shape) if input.numel() == output.numel() else input)
        return _finished(output)

    def _reduce_scatter(self, output, input, op):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.reshape(output.shape))
        return _finished(output)

    def _all_reduce(self, tensor, op):
        return _finished(tensor)

    def _broadcast(self, tensor, src):
        return _finished(tensor)


_DIST_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# torch >= 2.13 names these all_gather_single / reduce_scatter_single and warns on the old names;
# torch 2.9 (the one torch_xla 2.9 pins) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistCollectives(Collectives):
    """Collectives over a torch.distributed process group (gloo, nccl, hccl).

    Args:
        native_avg: the process group implements ReduceOp.AVG; otherwise SUM then divide.
        reduce_scatter_via_all_reduce: implement reduce-scatter as an all-reduce of the whole buffer
            and a copy of this rank's slice (faster than gloo's own reduce-scatter).
        all_gather_via_broadcast: implement all-gather as one broadcast per rank into the output's
            slices (faster than gloo's own all-gather; no staging copy).
        group: the process group (default: the world).
    """

    def __init__(
        self,
        native_avg: bool = False,
        reduce_scatter_via_all_reduce: bool = False,
        all_gather_via_broadcast: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.native_avg = native_avg
        self.reduce_scatter_via_all_reduce = reduce_scatter_via_all_reduce
        self.all_gather_via_broadcast = all_gather_via_broadcast
        self._global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                              for r in range(self.world_size)]

    def _dist_op(self, op: str) -> tuple[dist.ReduceOp, float | None]:
        """The process-group op and the divisor to apply afterwards (SUM-then-divide for AVG)."""
        if op == "avg" and not self.native_avg:
            return dist.ReduceOp.SUM, float(self.world_size)
        return _DIST_OPS[op], None

    def _all_gather(self, output, input):
        if self.all_gather_via_broadcast:
            chunks = output.view(-1).chunk(self.world_size)
            chunks[self.rank].copy_(input.view(-1))
            works = [
                dist.broadcast(chunk, src=self._global_ranks[r], group=self.group, async_op=True)
                for r, chunk in enumerate(chunks)
            ]
            return Handle(works, output)
        work = _all_gather_single(output, input, group=self.group, async_op=True)
        return Handle([work], output)

    def _reduce_scatter(self, output, input, op):
        dop, divisor = self._dist_op(op)
        if self.reduce_scatter_via_all_reduce:
            # The all-reduce works in place on the caller's input buffer, which the caller frees
            # (or reuses) after the handle completes: no extra memory beyond what FSDP holds anyway.
            work = dist.all_reduce(input, op=dop, group=self.group, async_op=True)
            mine = input.view(-1).chunk(self.world_size)[self.rank]

            def finish() -> None:
                output.view(-1).copy_(mine)
                if divisor is not None:
                    output.div_(divisor)

            return Handle([work], output, finish)
        work = _reduce_scatter_single(output, input, op=dop, group=self.group, async_op=True)
        return Handle([work], output, (lambda: output.div_(divisor)) if divisor is not None else None)

    def _all_reduce(self, tensor, op):
        dop, divisor = self._dist_op(op)
        work = dist.all_reduce(tensor, op=dop, group=self.group, async_op=True)
        return Handle([work], tensor, (lambda: tensor.div_(divisor)) if divisor is not None else None)

    def _broadcast(self, tensor, src):
        work = dist.broadcast(tensor, src=self._global_ranks[src], group=self.group, async_op=True)
        return Handle([work], tensor)

    def barrier(self) -> None:
        dist.barrier(group=self.group)
