"""``DistCollectives``: collectives over a torch.distributed process group (gloo, nccl, hccl).

Options choose, per operation, the fastest way a process group can do the job (gloo's own
reduce-scatter and all-gather are slow; see ``backends/devices/cpu.py`` and ``benchmarks/collectives_gloo.py``):
the reduce-scatter forms (``REDUCE_SCATTER_FORMS``), all-gather as broadcasts (on 2 ranks a send and a
receive), and, for the list forms, each large tensor moved in place while the small ones travel packed
(``PACK_BELOW_BYTES``), whose cost on gloo is the round trip of an operation, not their bytes.
``verify_same_collectives`` compares the ranks' traces: at the first optimizer step with one tiny
all-reduce, later off the training path (``agreement.py``), the entries of a mismatch read through the
job's key-value store.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError
from ..diagnostics.monitor import CollectiveMonitor
from .accounting import _nbytes
from .agreement import CollectiveAgreement, check_every_step
from .handle import Handle, Output
from .interface import Collectives
from .trace import _MISMATCH_HINT, describe_mismatch

if TYPE_CHECKING:
    from torch.distributed import Work  # a process group's in-flight operation

log = logging.getLogger("xshard.backends")

#: the ways ``DistCollectives`` can do a reduce-scatter (its ``reduce_scatter_form``)
ReduceScatterForm: TypeAlias = Literal["native", "all_reduce", "reduce", "exchange"]
REDUCE_SCATTER_FORMS: tuple[ReduceScatterForm, ...] = ("native", "all_reduce", "reduce", "exchange")
#: the elementwise reduction of each op but the average (a sum, then a divide) where a rank reduces itself
_LOCAL_REDUCE: dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "max": torch.maximum,
                                                          "min": torch.minimum}


#: a list form's tensors whose piece per rank is smaller than this travel packed into one operation
#: (``DistCollectives`` with the gloo options, which otherwise work on each tensor in place): what a
#: small tensor costs on gloo is its operation (queued to gloo's threads, a message each way), not its
#: bytes, and copying a few small pieces in and out of one buffer is cheap beside that. A transformer
#: layer's biases and norms are such pieces: of a Qwen2 layer's 12 parameters, 5, so a stage-3 unit's
#: gather on 2 ranks issues 16 operations instead of 24 (benchmarks/RESULTS.md, "By model size").
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


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of one storage (an output that may alias its input)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same elements (an in-place gather's input is its own output slice)."""
    return (a.device == b.device and a.dtype == b.dtype and a.numel() == b.numel()
            and a.data_ptr() == b.data_ptr() and b.is_contiguous())


#: the point-to-point tag of a 2-rank all-gather's messages (``_exchange``'s have gloo's default, 0): a gather
#: then matches only a gather, as its broadcasts did. Where ranks issue different collectives (one gathers
#: while the other reduces), messages under one tag would meet a receive of another size, which gloo's
#: transport thread answers with std::terminate; apart, they wait, and the collective monitor names the
#: difference (tests/test_collectives_agreement.py).
_GATHER_TAG = 1

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
            ``backends/devices/cpu.py`` for the CPU backend's choice, and why):
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
        #: compares the ranks' collectives off the training path (where the job has a collective monitor)
        self.agreement: CollectiveAgreement | None = None
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._every_step = check_every_step() and group is None
        if self._every_step and self.rank == 0:
            log.warning("XSHARD_CHECK_COLLECTIVES=every-step: every optimizer step compares the ranks' collectives "
                        "with a blocking all-reduce, so the host waits for the device at each step; unset it "
                        "for full speed (the check then runs off the training path)")
        self.native_avg = native_avg
        if reduce_scatter_form not in REDUCE_SCATTER_FORMS:
            raise ValueError(f"reduce_scatter_form {reduce_scatter_form!r} is not one of {REDUCE_SCATTER_FORMS}")
        self.reduce_scatter_form = reduce_scatter_form
        self.all_gather_via_broadcast = all_gather_via_broadcast
        self._global_ranks = [dist.get_global_rank(group, r) if group is not None else r
                              for r in range(self.world_size)]
        if group is not None:
            self.group_name = _ranks_text(self._global_ranks)
        if timeout is not None and self.world_size > 1 and group is None and monitor_enabled():
            store = _job_store()
            if store is not None:
                self.monitor = CollectiveMonitor(store, self.rank, self.world_size, timeout=timeout,
                                                 flight=self.flight)
                self.agreement = CollectiveAgreement(self.monitor, self.rank, self.world_size)

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
        """All-gather as one broadcast per rank straight into ``output``'s slices (in place).

        On 2 ranks each broadcast has one receiver, so it is a send and a receive: posted as
        point-to-point operations they run in both directions at once, outside the queue of gloo's
        collective threads. Alone, a gather takes the same time either way (benchmarks/collectives_gloo.py
        at 0.125, 1 and 64 MiB); in a stage-3 step of many small units, where gathers follow one another
        and overlap the reduces, the step takes about 0.9x the time (benchmarks/RESULTS.md, "Per-unit host
        cost"). Messages between the two ranks match in the order they are posted, the same on both (as
        for ``_exchange``), under a tag of their own (``_GATHER_TAG``).
        """
        n = input.numel()
        flat = output.view(-1)
        mine = flat[self.rank * n:(self.rank + 1) * n]
        if not _same_memory(mine, input):
            mine.copy_(input.reshape(-1))
        if self.world_size == 2:
            peer = 1 - self.rank
            return [dist.isend(mine, dst=self._global_ranks[peer], group=self.group, tag=_GATHER_TAG),
                    dist.irecv(flat[peer * n:(peer + 1) * n], src=self._global_ranks[peer], group=self.group,
                               tag=_GATHER_TAG)]
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
        """Check that every rank issued the same collectives since the last check; on a difference, raise
        ``CollectiveMismatchError`` on every rank, naming the first collective where the ranks differ.

        The first check (the first optimizer step) and, under ``XSHARD_CHECK_COLLECTIVES=every-step``, every
        check compare at once, with one all-reduce whose result the host reads (it waits for the device).
        Every later one only hands the step's record to the collective monitor's thread, which compares
        the ranks' records through the job's store off the training path; a mismatch it found is raised
        here, at the next check (``agreement.py``: why, and how soon). Not counted in the byte counter.
        """
        self._checks += 1
        agreement = self.agreement
        if agreement is not None:
            agreement.raise_if_mismatched()
        if self._checks == 1 or self._every_step:
            self._verify_now()
        elif agreement is not None:
            agreement.close_step(self._checks, *self.trace.take())
        else:  # no monitor (XSHARD_MONITOR=0, or no store): the first step was checked, the rest is not
            self.trace.reset()

    def _verify_now(self) -> None:
        """Compare every rank's (count, fingerprint) since the last check with one all-reduce (max of the values
        and of their negations), the store giving the entries for the message."""
        trace = self.trace
        mine = [float(trace.count), float(trace.fingerprint & 0xFFFFFF)]  # exact in fp32
        probe = torch.tensor(mine + [-v for v in mine], dtype=torch.float32, device=self.device)
        self._all_reduce(probe, "max").wait()
        high, low = probe[:2].tolist(), [-v for v in probe[2:].tolist()]
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


def _ranks_text(ranks: list[int]) -> str:
    """Global ranks as the flight recorder names a group: "ranks 8-15", "ranks 0,8,16"."""
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


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
