"""``Collectives``: the typed front the sharded core calls, and its checks and averages.

Each public method checks its arguments, counts and traces the call in the job's books, applies the
average and hands back a ``Handle`` (async) or waits; implementations provide the ``_``-prefixed
primitives.

Reduce ops are a capability (a backend's ``native_avg``): NCCL and HCCL implement ReduceOp.AVG
(torch_npu's ProcessGroupHCCL sums, then divides on its stream; see ``backends/devices/npu.py``); where the
process group has none (gloo, MPS, torch_xla) the average is a SUM followed by a divide, done when
the handle is waited on.

Averages (``op="avg"``) are computed in one place, ``average_factors``: the collective's own AVG where
the process group has one, else SUM then divide; fp16 sums of N values can overflow, so fp16 is
pre-divided by about sqrt(N) and post-divided by the rest (as PyTorch FSDP does).

The list forms (``all_gather_into_tensors`` / ``reduce_scatter_tensors``) are one logical operation
each. Each implementation picks the cheapest way: by default (here) one collective over a packed
buffer (what suits NCCL, HCCL and XLA: few large operations); ``DistCollectives`` with the gloo options
works on each large tensor in place and packs only the small ones.

Subgroups (hybrid sharding: a shard group inside a node, a replica group across nodes): collectives over
a subgroup are ``Collectives`` of their own, made by the Backend (``group_collectives``) and tied to the
job's world collectives with ``share_books``: they add to the same byte counter, under their kind plus
a suffix naming the group (e.g. ``all_reduce_inter`` for the replica group), to the same trace (so
``verify_same_collectives`` compares them too) and to the same numbering of the hang diagnosis.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from ..diagnostics.flight_recorder import FlightEntry, FlightRecorder
from ..diagnostics.monitor import CollectiveMonitor
from .accounting import CommCounter, _nbytes
from .handle import IN_FLIGHT, Handle, _finished
from .trace import CollectiveTrace

REDUCE_OPS = ("sum", "avg", "max", "min")


def average_factors(dtype: torch.dtype, world_size: int) -> tuple[str, float, float]:
    """(op, pre-divide, post-divide) for an average over ``world_size`` ranks of ``dtype`` values.

    fp16 sums of N values can overflow: divide by about sqrt(N) before and the rest after (as PyTorch
    FSDP does). Other dtypes use "avg" (native where the backend has it, SUM then divide otherwise).
    """
    if dtype == torch.float16 and world_size > 1:
        pre = 1.0
        while world_size % (pre * 2) == 0 and world_size / (pre * 2) >= pre * 2:
            pre *= 2
        return "sum", pre, world_size / pre
    return "avg", 1.0, 1.0


class Collectives:
    """The interface the sharded core uses. Subclasses implement the ``_``-prefixed primitives."""

    rank: int = 0
    world_size: int = 1
    #: the ranks this object's collectives run over, as the flight recorder names them
    group_name: str = "world"
    #: where this process's collective buffers live (NCCL and HCCL move device tensors only)
    device: torch.device = torch.device("cpu")

    def __init__(self) -> None:
        self.counter = CommCounter()
        self.trace = CollectiveTrace()
        #: the last collectives, with their times, written when the job fails (``diagnostics/flight_recorder.py``)
        self.flight = FlightRecorder()
        self._entry: FlightEntry | None = None
        #: collectives issued by this process, ever (numbers them for the hang diagnosis)
        self.issued = 0
        self._label = ""
        self.monitor: CollectiveMonitor | None = None
        #: appended to every kind this object counts (``"_inter"``: ``all_reduce_inter``); see ``share_books``
        self.kind_suffix = ""
        #: the object whose counter, trace, numbering and monitor this one uses (itself unless shared)
        self._books: Collectives = self

    def share_books(self, parent: Collectives, kind_suffix: str = "") -> Collectives:
        """Count into ``parent``'s books: its byte counter (kinds + ``kind_suffix``), its trace (what
        ``verify_same_collectives`` compares) and its numbering and monitor (the hang diagnosis).

        For subgroup collectives: one step's traffic, over every group, then shows in one counter,
        and a rank that skipped a subgroup collective is caught like one that skipped any other.
        Returns ``self``.
        """
        books = parent._books
        self._books = books
        self.counter = books.counter
        self.trace = books.trace
        self.flight = books.flight
        self.kind_suffix = kind_suffix
        return self

    # All public methods return a Handle when async_op=True, else None (the work is done). ``tag``
    # names what the call moves, for the collective trace and for error messages.

    @overload
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor,
                               async_op: Literal[False] = ...,
                               tag: str | None = ...) -> None: ...
    @overload
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, async_op: Literal[True],
                               tag: str | None = ...) -> Handle: ...
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                               tag: str | None = None) -> Handle | None:
        """Concatenate every rank's ``input`` (equal sizes) into ``output`` along dim 0."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements, expected "
                f"{input.numel()} x world size {self.world_size}"
            )
        self._record("all_gather", tag, _nbytes(output), output.numel())
        return self._result(self._all_gather(output, input), async_op)

    @overload
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: str = ..., async_op: Literal[False] = ...,
                              tag: str | None = ...) -> None: ...
    @overload
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: str = ..., *, async_op: Literal[True],
                              tag: str | None = ...) -> Handle: ...
    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "avg", async_op: bool = False,
        tag: str | None = None,
    ) -> Handle | None:
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
        self._record("reduce_scatter", tag, _nbytes(input), input.numel())
        op, post = self._pre_average(op, input.dtype, [input])
        return self._result(self._post_average(self._reduce_scatter(output, input, op), [output], post), async_op)

    @overload
    def all_reduce(self, tensor: torch.Tensor, op: str = ..., async_op: Literal[False] = ...,
                   tag: str | None = ...) -> None: ...
    @overload
    def all_reduce(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
                   tag: str | None = ...) -> Handle: ...
    def all_reduce(self, tensor: torch.Tensor, op: str = "avg", async_op: bool = False,
                   tag: str | None = None) -> Handle | None:
        """Reduce ``tensor`` in place over all ranks."""
        _check_op(op)
        self._record("all_reduce", tag, 2 * _nbytes(tensor), tensor.numel())
        op, post = self._pre_average(op, tensor.dtype, [tensor])
        return self._result(self._post_average(self._all_reduce(tensor, op), [tensor], post), async_op)

    @overload
    def all_gather_into_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                async_op: Literal[False] = ...,
                                tag: str | None = ...) -> None: ...
    @overload
    def all_gather_into_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                *, async_op: Literal[True],
                                tag: str | None = ...) -> Handle: ...
    def all_gather_into_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                async_op: bool = False, tag: str | None = None) -> Handle | None:
        """``all_gather_into_tensor`` for each pair, as one operation (one call, the outputs' bytes).

        Each output is contiguous with ``world_size`` times its input's elements. An input may be a
        view of its own output's chunk for this rank (in-place gather: nothing is staged for it).
        """
        _check_pairs("all_gather_into_tensors", outputs, inputs, self.world_size, gather=True)
        self._record("all_gather", tag, sum(_nbytes(o) for o in outputs), sum(o.numel() for o in outputs))
        return self._result(self._all_gather_many(list(outputs), list(inputs)), async_op)

    @overload
    def reduce_scatter_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                               op: str = ..., async_op: Literal[False] = ...,
                               tag: str | None = ...) -> None: ...
    @overload
    def reduce_scatter_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                               op: str = ..., *, async_op: Literal[True],
                               tag: str | None = ...) -> Handle: ...
    def reduce_scatter_tensors(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                               op: str = "avg", async_op: bool = False,
                               tag: str | None = None) -> Handle | None:
        """``reduce_scatter_tensor`` for each pair, as one operation (one call, the inputs' bytes).

        Inputs are contiguous, of one dtype, ``world_size`` times their output's elements, and
        scratch (they may be reduced in place).
        """
        _check_op(op)
        _check_pairs("reduce_scatter_tensors", outputs, inputs, self.world_size, gather=False)
        if len({t.dtype for t in inputs}) > 1:
            raise ValueError("reduce_scatter_tensors: inputs must share one dtype, got "
                             f"{sorted(str(d) for d in {t.dtype for t in inputs})}")
        self._record("reduce_scatter", tag, sum(_nbytes(i) for i in inputs), sum(i.numel() for i in inputs))
        op, post = self._pre_average(op, inputs[0].dtype, inputs)
        handle = self._reduce_scatter_many(list(outputs), list(inputs), op)
        return self._result(self._post_average(handle, outputs, post), async_op)

    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = ..., async_op: Literal[False] = ...,
                  tag: str | None = ...) -> None: ...
    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = ..., *, async_op: Literal[True],
                  tag: str | None = ...) -> Handle: ...
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False,
                  tag: str | None = None) -> Handle | None:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        self._record("broadcast", tag, _nbytes(tensor), tensor.numel())
        return self._result(self._broadcast(tensor, src), async_op)

    def barrier(self) -> None:
        """Wait until every rank reaches this point.

        Numbered and watched by the hang monitor like every other collective (not counted in bytes,
        not part of ``verify_same_collectives``): ``wait_for_everyone``, ``main_process_first`` and the
        barriers of save/load all come here, so a rank that never arrives is named.
        """
        books = self._books
        books.issued += 1
        entry = books.flight.issue(books.issued, "barrier", None, self.group_name, 0)
        self._barrier().watch(books.monitor, books.issued, "barrier", entry).wait()

    def _barrier(self) -> Handle:
        return _finished(None)

    def verify_same_collectives(self) -> None:
        """Check that every rank issued the same collectives since the last check (then start anew).

        A no-op where there is nothing to compare (one process) or nothing to ask with (compiled
        devices, whose ranks run one graph each); see ``DistCollectives``.
        """
        self.trace.reset()

    # ------------------------------------------------------------------ accounting and averages
    def _record(self, kind: str, tag: str | None, nbytes: int, numel: int) -> None:
        kind += self.kind_suffix
        books = self._books
        books.counter.add(kind, nbytes)
        books.trace.record(kind, tag, numel)
        books.issued += 1
        books._label = tag or kind
        books._entry = books.flight.issue(books.issued, kind, tag, self.group_name, nbytes)

    def _pre_average(self, op: str, dtype: torch.dtype, inputs: list[torch.Tensor]) -> tuple[str, float]:
        """The op to issue for ``op`` on ``inputs``, pre-dividing them where ``average_factors`` says;
        returns (op, post-divide)."""
        if op != "avg":
            return op, 1.0
        op, pre, post = average_factors(dtype, self.world_size)
        if pre != 1.0:
            for t in inputs:
                t.div_(pre)
        return op, post

    @staticmethod
    def _post_average(handle: Handle, outputs: list[torch.Tensor], post: float) -> Handle:
        """``handle``, with its outputs divided by ``post`` when it completes (no-op for 1.0)."""
        if post == 1.0:
            return handle

        def divide() -> None:
            for t in outputs:
                t.div_(post)

        return Handle([handle], outputs, divide)

    def _result(self, handle: Handle, async_op: bool) -> Handle | None:
        books = self._books
        handle.watch(books.monitor, books.issued, books._label, books._entry)
        if async_op:
            IN_FLIGHT.add(1)
            handle._counted = True
            return handle
        handle.wait()
        return None

    # primitives: each returns a Handle (possibly already finished)
    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        raise NotImplementedError

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        raise NotImplementedError

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        raise NotImplementedError

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        raise NotImplementedError

    def _all_gather_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Handle:
        """Default: pack the inputs into one buffer, one all-gather, copy each rank's rows out."""
        if len(outputs) == 1:
            return self._all_gather(outputs[0].view(-1), inputs[0].reshape(-1))
        world = self.world_size
        # one dtype: a buffer of it; mixed dtypes (fp32 norms beside bf16 weights): a byte buffer
        as_bytes = len({t.dtype for t in inputs}) > 1
        flat_in = [_flat(t, as_bytes) for t in inputs]
        offsets, row = _offsets([t.numel() for t in flat_in])
        send = torch.cat(flat_in)
        recv = torch.empty(world * row, dtype=send.dtype, device=send.device)
        inner = self._all_gather(recv, send)

        def unpack() -> None:
            grid = recv.view(world, row)
            for out, t, off in zip(outputs, flat_in, offsets, strict=True):
                _flat(out, as_bytes).view(world, t.numel()).copy_(grid[:, off:off + t.numel()])

        return Handle([inner], outputs, unpack)

    def _reduce_scatter_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                             op: str) -> Handle:
        """Default: pack the inputs rank-major into one buffer, one reduce-scatter, copy each slice out."""
        if len(outputs) == 1:
            return self._reduce_scatter(outputs[0].view(-1), inputs[0].view(-1), op)
        world = self.world_size
        sizes = [o.numel() for o in outputs]
        offsets, row = _offsets(sizes)
        buf = torch.empty(world, row, dtype=inputs[0].dtype, device=inputs[0].device)
        for t, off, n in zip(inputs, offsets, sizes, strict=True):
            buf[:, off:off + n].copy_(t.view(world, n))
        out = torch.empty(row, dtype=buf.dtype, device=buf.device)
        inner = self._reduce_scatter(out, buf.view(-1), op)

        def unpack() -> None:
            for o, off, n in zip(outputs, offsets, sizes, strict=True):
                o.view(-1).copy_(out[off:off + n])

        return Handle([inner], outputs, unpack)


def _flat(t: torch.Tensor, as_bytes: bool) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if as_bytes and flat.dtype != torch.uint8 else flat


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n
    return offsets, pos


def _check_pairs(name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], world_size: int,
                 gather: bool) -> None:
    if len(outputs) != len(inputs):
        raise ValueError(f"{name}: {len(outputs)} outputs for {len(inputs)} inputs; pass one output per input")
    for i, (o, t) in enumerate(zip(outputs, inputs, strict=True)):
        small, big = (t, o) if gather else (o, t)
        if big.numel() != small.numel() * world_size:
            raise ValueError(f"{name}: pair {i} has {big.numel()} full elements, expected "
                             f"{small.numel()} x world size {world_size}")
        if not big.is_contiguous() or not o.is_contiguous():
            raise ValueError(f"{name}: pair {i} is not contiguous; pass contiguous tensors (e.g. .contiguous())")


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of {REDUCE_OPS}")
