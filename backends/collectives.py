"""Collectives: all_gather / reduce_scatter / all_reduce / broadcast / barrier, with a byte counter.

Three implementations share one interface:
- ``DistCollectives``: torch.distributed (gloo, nccl, hccl). Options choose, per operation, the fastest
  way a process group can do the job (gloo's own reduce-scatter and all-gather are slow; see
  ``backends/cpu.py`` and ``benchmarks/collectives_gloo.py``).
- ``SingleProcessCollectives``: world size 1; every call is a local copy or nothing.
- torch_xla's, in ``backends/xla.py``.

Reduce ops are a capability (a backend's ``native_avg``): NCCL and HCCL implement ReduceOp.AVG
(torch_npu's ProcessGroupHCCL sums, then divides on its stream; see ``backends/npu.py``); where the
process group has none (gloo, MPS, torch_xla) the average is a SUM followed by a divide, done when
the handle is waited on.

Byte accounting follows the ZeRO paper's convention so that counts compare with theory
(ZeRO-3 = 3 psi per step, ZeRO-2 and DDP = 2 psi): an all-gather or a reduce-scatter counts the size
of the full (unsharded) tensor, an all-reduce twice the tensor (it is a reduce-scatter plus an
all-gather), a broadcast the tensor once. These are logical payloads, independent of the wire
algorithm, so the same training step counts the same bytes on every backend.

The list forms (``all_gather_into_tensors`` / ``reduce_scatter_tensors``) gather or reduce several
tensors (one sharded unit's parameters or gradients) as one logical operation: they count one call
and the sum of the tensors' bytes, exactly as one flat operation over a packed buffer would. Each
implementation picks the cheapest way: by default one collective over a packed buffer (what suits
NCCL, HCCL and XLA: few large operations); ``DistCollectives`` with the gloo options works on each
large tensor in place and packs only the small ones (``PACK_BELOW_BYTES``), whose cost on gloo is the
round trip of an operation, not their bytes.

Averages (``op="avg"``) are computed in one place, ``average_factors``: the collective's own AVG where
the process group has one, else SUM then divide; fp16 sums of N values can overflow, so fp16 is
pre-divided by about sqrt(N) and post-divided by the rest (as PyTorch FSDP does).

Subgroups (hybrid sharding: a shard group inside a node, a replica group across nodes): collectives over
a subgroup are ``Collectives`` of their own, made by the Backend (``group_collectives``) and tied to the
job's world collectives with ``share_books``: they add to the same byte counter, under their kind plus
a suffix naming the group (e.g. ``all_reduce_inter`` for the replica group), to the same trace (so
``verify_same_collectives`` compares them too) and to the same numbering of the hang diagnosis.

Every call may carry a ``tag`` naming what it moves (e.g. "all-gather of unit layers.3"). Calls are
numbered and fingerprinted (``CollectiveTrace``), so ``verify_same_collectives`` can tell, with one
tiny all-reduce, whether every rank issued the same collectives since the last check, and name the
first one where they differ (see ``DistCollectives``).
"""

from __future__ import annotations

import json
import threading
import zlib
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, overload

import torch
import torch.distributed as dist

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, RankDiedError
from .monitor import CollectiveMonitor

if TYPE_CHECKING:
    from torch.distributed import Work  # a process group's in-flight operation

REDUCE_OPS = ("sum", "avg", "max", "min")
#: the ways ``DistCollectives`` can do a reduce-scatter (its ``reduce_scatter_form``)
ReduceScatterForm: TypeAlias = Literal["native", "all_reduce", "reduce", "exchange"]
REDUCE_SCATTER_FORMS: tuple[ReduceScatterForm, ...] = ("native", "all_reduce", "reduce", "exchange")
#: the elementwise reduction of each op but the average (a sum, then a divide) where a rank reduces itself
_LOCAL_REDUCE: dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "max": torch.maximum,
                                                          "min": torch.minimum}

#: what a finished collective hands back: its output tensor, the outputs of a list form, or None (a barrier)
Output: TypeAlias = "torch.Tensor | list[torch.Tensor] | None"


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveTrace:
    """What this process issued since the last ``reset``: a count, a fingerprint, the latest entries.

    The fingerprint chains a CRC of every entry (kind, tag, elements), so two ranks that issued the
    same collectives in the same order have the same (count, fingerprint). Only the last ``keep``
    entries are kept as text, for error messages (a long evaluation without checks stays bounded).
    """

    def __init__(self, keep: int = 512) -> None:
        self.count = 0
        self.fingerprint = 0
        self.entries: deque[str] = deque(maxlen=keep)

    def record(self, kind: str, tag: str | None, numel: int) -> None:
        entry = f"{tag or kind} ({numel} elements)"
        self.count += 1
        self.fingerprint = zlib.crc32(entry.encode(), self.fingerprint)
        self.entries.append(entry)

    def reset(self) -> None:
        self.count = 0
        self.fingerprint = 0
        self.entries.clear()

    def numbered(self) -> list[tuple[int, str]]:
        """The kept entries with their 1-based numbers since the last reset."""
        first = self.count - len(self.entries) + 1
        return [(first + i, e) for i, e in enumerate(self.entries)]


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


class InFlight:
    """How many async handles this process handed out and has not waited to completion (every
    ``Collectives`` object counts here). 0: no collective of this process is in flight, so its process
    group can be left without waiting for a peer (``CommunicationAPI.leave_at_exit``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._count += n

    @property
    def count(self) -> int:
        return self._count


IN_FLIGHT = InFlight()


class Handle:
    """An asynchronous collective in flight. ``wait()`` blocks until it is done and returns its output.

    ``finish`` runs once after the underlying work completes (e.g. the divide of a SUM-then-divide
    average, or the copy of this rank's slice out of an all-reduce).
    """

    __slots__ = ("_works", "_finish", "_output", "_done", "_monitor", "_label", "_counted")

    def __init__(self, works: Sequence[Work | Handle | None], output: Output,
                 finish: Callable[[], object] | None = None) -> None:
        self._works = works
        self._finish = finish
        self._output = output
        self._done = False
        self._monitor: CollectiveMonitor | None = None
        self._label: tuple[int, str] = (0, "")
        #: counted in ``IN_FLIGHT`` until waited (async handles handed to a caller)
        self._counted = False

    def watch(self, monitor: CollectiveMonitor | None, number: int, description: str) -> Handle:
        """Report waits on this handle to ``monitor`` as collective ``number`` (see ``backends.monitor``)."""
        self._monitor, self._label = monitor, (number, description)
        return self

    def wait(self) -> Output:
        """Block until the work is done (then run ``finish`` once); the output, or None for a barrier."""
        if not self._done:
            monitor = self._monitor
            if monitor is not None:
                monitor.waiting(*self._label)
            try:
                for w in self._works:
                    if w is not None:
                        w.wait()
            except RuntimeError as exc:  # a timeout, or a peer that died mid-collective
                if monitor is None:
                    raise
                reported = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                died, message = monitor.explain_failure(reported)
                kind = RankDiedError if died else CollectiveTimeoutError
                raise kind(f"{message} (the process group reported: {reported})") from exc
            finally:
                if monitor is not None:
                    monitor.done(*self._label)
            if self._finish is not None:
                self._finish()
            # what the work held (an exchange's inbox, a packing buffer) is not needed any more
            self._works, self._finish = (), None
            self._done = True
            if self._counted:
                IN_FLIGHT.add(-1)
        return self._output

    @property
    def done(self) -> bool:
        """Has ``wait()`` completed?"""
        return self._done


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of one storage (an output that may alias its input)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same elements (an in-place gather's input is its own output slice)."""
    return (a.device == b.device and a.dtype == b.dtype and a.numel() == b.numel()
            and a.data_ptr() == b.data_ptr() and b.is_contiguous())


def _finished(output: Output) -> Handle:
    h = Handle([], output)
    h._done = True
    return h


class Collectives:
    """The interface the sharded core uses. Subclasses implement the ``_``-prefixed primitives."""

    rank: int = 0
    world_size: int = 1
    #: where this process's collective buffers live (NCCL and HCCL move device tensors only)
    device: torch.device = torch.device("cpu")

    def __init__(self) -> None:
        self.counter = CommCounter()
        self.trace = CollectiveTrace()
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
        self._barrier().watch(books.monitor, books.issued, "barrier").wait()

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
        handle.watch(books.monitor, books.issued, books._label)
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


#: a list form's tensors whose piece per rank is smaller than this travel packed into one operation
#: (``DistCollectives`` with the gloo options, which otherwise work on each tensor in place): what a
#: small tensor costs on gloo is its operation (queued to gloo's threads, a message each way), not its
#: bytes, and copying a few small pieces in and out of one buffer is cheap beside that. A transformer
#: layer's biases and norms are such pieces: of a Qwen2 layer's 12 parameters, 5, so a stage-3 unit's
#: gather on 2 ranks issues 16 broadcasts instead of 24 (benchmarks/RESULTS.md, "By model size").
PACK_BELOW_BYTES = 64 * 2**10


def _split_small(inputs: list[torch.Tensor], per_rank: int) -> tuple[list[int], list[int]]:
    """The indices of the inputs to pack together (``per_rank``-th of each under ``PACK_BELOW_BYTES``,
    when there are two or more of them) and of those to move one by one. The same on every rank: the
    ranks' inputs have the same sizes."""
    small = [i for i, t in enumerate(inputs) if _nbytes(t) // per_rank < PACK_BELOW_BYTES]
    if len(small) < 2:
        small = []
    chosen = set(small)
    return small, [i for i in range(len(inputs)) if i not in chosen]


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
        reduce_scatter_form: how a reduce-scatter is done (``REDUCE_SCATTER_FORMS``; see
            ``backends/cpu.py`` for the CPU backend's choice, and why):
            ``"native"``, the process group's own reduce-scatter; ``"all_reduce"``, an all-reduce of
            the whole input and a copy of this rank's slice (it moves an all-reduce's bytes: at stage 3
            a step then sends 4 psi where 3 psi is the logical figure); ``"reduce"``, one ``reduce``
            per rank of that rank's slice to that rank; ``"exchange"``, point-to-point: every rank
            sends each peer that peer's slice and reduces the copies of its own slice itself (the
            logical bytes of a reduce-scatter, ``(world - 1) / world`` of the input sent per rank).
        all_gather_via_broadcast: implement all-gather as one broadcast per rank into the output's
            slices (faster than gloo's own all-gather; no staging copy but for the small tensors of a list
            form, packed into one operation: ``PACK_BELOW_BYTES``).
        group: the process group (default: the world).
        device: where this process's collective buffers live (the backend's device; NCCL and HCCL
            move device tensors only), for the small control tensors of ``verify_same_collectives``.
        timeout: the process group's timeout in seconds; when given (and the job has a key-value
            store), a ``CollectiveMonitor`` diagnoses waits that outlast 90% of it.
    """

    def __init__(
        self,
        native_avg: bool = False,
        reduce_scatter_form: ReduceScatterForm = "native",
        all_gather_via_broadcast: bool = False,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.device = torch.device(device)
        self._checks = 0
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.native_avg = native_avg
        if reduce_scatter_form not in REDUCE_SCATTER_FORMS:
            raise ValueError(f"reduce_scatter_form {reduce_scatter_form!r} is not one of {REDUCE_SCATTER_FORMS}")
        self.reduce_scatter_form = reduce_scatter_form
        self.all_gather_via_broadcast = all_gather_via_broadcast
        self._global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                              for r in range(self.world_size)]
        if timeout is not None and self.world_size > 1 and group is None and monitor_enabled():
            store = _job_store()
            if store is not None:
                self.monitor = CollectiveMonitor(store, self.rank, self.world_size, deadline=0.9 * timeout)

    def _dist_op(self, op: str) -> tuple[dist.ReduceOp.RedOpType, float | None]:
        """The process-group op and the divisor to apply afterwards (SUM-then-divide for AVG)."""
        if op == "avg" and not self.native_avg:
            return dist.ReduceOp.SUM, float(self.world_size)
        return _DIST_OPS[op], None

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        if self.all_gather_via_broadcast:
            return Handle(self._broadcast_slices(output, input), output)
        work = _all_gather_single(output, input, group=self.group, async_op=True)
        return Handle([work], output)

    def _broadcast_slices(self, output: torch.Tensor, input: torch.Tensor) -> list[Work | None]:
        """All-gather as one broadcast per rank straight into ``output``'s slices (in place)."""
        n = input.numel()
        flat = output.view(-1)
        mine = flat[self.rank * n:(self.rank + 1) * n]
        if not _same_memory(mine, input):
            mine.copy_(input.reshape(-1))
        return [dist.broadcast(flat[r * n:(r + 1) * n], src=self._global_ranks[r], group=self.group, async_op=True)
                for r in range(self.world_size)]

    def _all_gather_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Handle:
        if not self.all_gather_via_broadcast:
            return super()._all_gather_many(outputs, inputs)
        small, large = _split_small(inputs, per_rank=1)
        works: list[Work | Handle | None] = [w for i in large for w in self._broadcast_slices(outputs[i], inputs[i])]
        if small:
            works.append(super()._all_gather_many([outputs[i] for i in small], [inputs[i] for i in small]))
        return Handle(works, outputs)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        if self.reduce_scatter_form != "native":
            return self._reduce_scatter_by_form([output], [input], op, output)
        dop, divisor = self._dist_op(op)
        work = _reduce_scatter_single(output, input, op=dop, group=self.group, async_op=True)
        return Handle([work], output, (lambda: output.div_(divisor)) if divisor is not None else None)

    def _reduce_scatter_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                             op: str) -> Handle:
        if self.reduce_scatter_form == "native":
            return super()._reduce_scatter_many(outputs, inputs, op)
        small, large = _split_small(inputs, per_rank=self.world_size)
        works: list[Work | Handle | None] = []
        if large:
            works.append(self._reduce_scatter_by_form([outputs[i] for i in large], [inputs[i] for i in large],
                                                      op, outputs))
        if small:
            works.append(super()._reduce_scatter_many([outputs[i] for i in small], [inputs[i] for i in small], op))
        return Handle(works, outputs)

    def _reduce_scatter_by_form(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], op: str,
                                result: Output) -> Handle:
        """Reduce-scatter with operations that beat gloo's own, each input taken as it is (it is the
        caller's scratch: no packing buffer).

        ``"all_reduce"``: one all-reduce of each input in place (every rank gets every slice);
        ``"reduce"``: one ``reduce`` of each rank's slice to that rank; then this rank's slice is
        copied out, with the average's divide folded into the copy. ``"exchange"``: ``_exchange``.
        """
        if self.reduce_scatter_form == "exchange":
            return self._exchange(outputs, inputs, op, result)
        dop, divisor = self._dist_op(op)
        if self.reduce_scatter_form == "reduce":
            works = []
            for t, out in zip(inputs, outputs, strict=True):
                n, flat = out.numel(), t.view(-1)
                works += [dist.reduce(flat[r * n:(r + 1) * n], dst=self._global_ranks[r], op=dop, group=self.group,
                                      async_op=True) for r in range(self.world_size)]
        else:
            works = [dist.all_reduce(t, op=dop, group=self.group, async_op=True) for t in inputs]

        def finish() -> None:
            for out, t in zip(outputs, inputs, strict=True):
                n = out.numel()
                mine = t.view(-1)[self.rank * n:(self.rank + 1) * n]
                if divisor is None:
                    out.view(-1).copy_(mine)
                else:
                    torch.div(mine, divisor, out=out.view(-1))

        return Handle(works, result, finish)

    def _exchange(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], op: str,
                  result: Output) -> Handle:
        """Reduce-scatter as point-to-point sends: each rank sends every peer that peer's slice of each
        input and receives the peers' copies of its own slice, then reduces them itself.

        Each rank sends ``(world - 1) / world`` of the input, the logical bytes of a reduce-scatter and
        half of what an all-reduce sends (a ring all-reduce is a reduce-scatter plus an all-gather).
        The lowest-ranked peer's copy is received straight into the output, the others' into an
        inbox (none at 2 ranks), freed when the handle is waited. The copies are reduced in rank
        order (the first two swapped, which IEEE addition, max and min do not notice), so the result
        does not depend on which message came first. All sends and receives are posted at once; each
        peer pair's messages match in the order they were posted, which is the same on every rank.
        """
        world, rank = self.world_size, self.rank
        reduce = _LOCAL_REDUCE["sum" if op == "avg" else op]
        works: list[Work | None] = []
        plans: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (the output, the copies to reduce into it)
        peers = [r for r in range(world) if r != rank]
        for t, out in zip(inputs, outputs, strict=True):
            n, flat, dest = out.numel(), t.view(-1), out.view(-1)
            into_output = not _shares_storage(dest, flat) and bool(peers)
            inbox = iter(torch.empty((len(peers) - into_output) * n, dtype=t.dtype, device=t.device).split(n))
            copies = []
            for r in range(world):
                piece = flat[r * n:(r + 1) * n]
                if r != rank:
                    works.append(dist.isend(piece, dst=self._global_ranks[r], group=self.group))
                    piece = dest if into_output and r == peers[0] else next(inbox)
                    works.append(dist.irecv(piece, src=self._global_ranks[r], group=self.group))
                copies.append(piece)
            plans.append((dest, copies))

        def finish() -> None:
            for dest, copies in plans:
                rest = [c for c in copies if c is not dest]
                if len(rest) < len(copies):  # one copy was received into the output: reduce the rest into it
                    for other in rest:
                        reduce(dest, other, out=dest)
                else:  # the output aliases the input (or there is no peer): reduce aside, then copy
                    total = reduce(copies[0], copies[1]) if len(copies) > 1 else copies[0]
                    for other in copies[2:]:
                        reduce(total, other, out=total)
                    dest.copy_(total)
                if op == "avg":
                    dest.div_(world)
            plans.clear()  # the inboxes go with them

        return Handle(works, result, finish)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        dop, divisor = self._dist_op(op)
        work = dist.all_reduce(tensor, op=dop, group=self.group, async_op=True)
        return Handle([work], tensor, (lambda: tensor.div_(divisor)) if divisor is not None else None)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        work = dist.broadcast(tensor, src=self._global_ranks[src], group=self.group, async_op=True)
        return Handle([work], tensor)

    def _barrier(self) -> Handle:
        return Handle([dist.barrier(group=self.group, async_op=True)], None)

    def verify_same_collectives(self) -> None:
        """Compare every rank's (count, fingerprint) since the last check with one all-reduce (max of
        the values and of their negations); on a difference, raise ``CollectiveMismatchError`` on every
        rank, naming the first collective where the ranks differ (entries exchanged through the job's
        key-value store). Not counted in the byte counter: it is control traffic.
        """
        trace = self.trace
        mine = [float(trace.count), float(trace.fingerprint & 0xFFFFFF)]  # exact in fp32
        probe = torch.tensor(mine + [-v for v in mine], dtype=torch.float32, device=self.device)
        self._all_reduce(probe, "max").wait()
        high, low = probe[:2].tolist(), [-v for v in probe[2:].tolist()]
        self._checks += 1
        if high == low:
            trace.reset()
            return
        raise CollectiveMismatchError(self._explain_mismatch())

    def _explain_mismatch(self) -> str:
        """Exchange the ranks' recent entries through the store and describe the first difference."""
        mine = {"count": self.trace.count, "entries": self.trace.numbered()}
        traces: dict[int, dict[str, Any]] = {self.rank: mine}
        try:
            store = _job_store()
            key = f"xshard/collective-trace/{self._checks}"
            store.set(f"{key}/{self.rank}", json.dumps(mine))
            for r in range(self.world_size):
                if r != self.rank:
                    traces[r] = json.loads(store.get(f"{key}/{self._global_ranks[r]}"))
        except Exception as exc:  # the store is only for the message; the mismatch itself is certain
            return (f"ranks issued different collectives since the last optimizer step (this rank issued "
                    f"{self.trace.count}; the others' lists could not be read: {exc}). " + _MISMATCH_HINT)
        return describe_mismatch(traces) + " " + _MISMATCH_HINT


def monitor_enabled() -> bool:
    """The hang diagnosis runs unless ``XSHARD_MONITOR=0`` (to measure what it costs)."""
    import os

    return os.environ.get("XSHARD_MONITOR", "1").strip().lower() not in ("0", "false", "no", "off")


def _job_store() -> Any:
    """The default process group's key-value store (thread-safe), or None where there is none."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


_MISMATCH_HINT = (
    "Every rank must run the same sharded units in the same order: a branch chosen by the data (or by "
    "the rank) that runs a unit on some ranks only mixes up their gradients. Keep such branches inside "
    "one unit (e.g. make their parent module the unit with transformer_layer_cls_to_wrap), or use stage "
    "0, which allows them; to run the model on one rank alone (e.g. generate() on rank 0), enter "
    "model.summon_full_params() on every rank first.")


def describe_mismatch(traces: dict[int, dict[str, Any]]) -> str:
    """The first collective (by number since the last check) at which ranks' entries differ."""
    by_number = {r: dict(map(tuple, t["entries"])) for r, t in traces.items()}
    counts = {r: t["count"] for r, t in traces.items()}
    for n in range(1, max(counts.values()) + 1):
        seen = {r: by_number[r].get(n, "nothing (it issued fewer collectives)" if n > counts[r] else None)
                for r in traces}
        known = {r: v for r, v in seen.items() if v is not None}
        if len(known) == len(seen) and len(set(known.values())) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in sorted(known.items()):
                groups.setdefault(v, []).append(r)
            parts = [f"{_ranks(rs)} issued {v!r}" for v, rs in groups.items()]
            return (f"ranks issued different collectives since the last optimizer step: at collective #{n}, "
                    + "; ".join(parts) + ".")
    totals = ", ".join(f"rank {r}: {c}" for r, c in sorted(counts.items()))
    return f"ranks issued different collectives since the last optimizer step (counts {totals})."


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
