"""Collectives over torch_xla's replica collectives (``xm.all_gather``, ``xm.reduce_scatter``, ...).

XLA is lazy: a collective here only records an operation in the pending graph, and the compiler
schedules it when the step's graph runs (``mark_step``). So every Handle is finished at once; the
overlap that streams and async work handles give on eager devices comes from the compiler here.

Every replica must trace the same graph (on PJRT each replica compiles its own copy, and
mismatched programs hang in their first collective): nothing below branches on the rank in Python.
The broadcast, for instance, masks with a rank tensor that is data, not a constant in the graph.

torch_xla's process group rejects ReduceOp.AVG; ``avg`` here is a SUM followed by a divide, the
same arithmetic as ``DistCollectives`` (not a sum scaled by 1/world size).

Non-finite values: torch_xla orders the collectives of one graph by feeding each the previous
one's result through a numeric token (seen in torch_xla 2.9: ``input + token * first element of
the previous result``). An inf or NaN there turns the whole next collective into NaN, on XLA:CPU
at least; ``DISABLE_NUMERIC_CC_TOKEN=1`` switches the token off. Overflow checks (fp16 loss
scaling) should look at values before they enter the next collective.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from . import Collectives, Handle, SingleProcessCollectives
from .handle import _finished

#: xshard's reduce op -> torch_xla's reduce type name (xm.REDUCE_SUM == "sum", ...)
_XLA_REDUCE = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}
#: the same reductions over the replica dimension of a gathered tensor
_LOCAL_REDUCE = {
    "sum": lambda t: t.sum(0),
    "avg": lambda t: t.sum(0),
    "max": lambda t: t.amax(0),
    "min": lambda t: t.amin(0),
}


def xla_model() -> Any:
    """``torch_xla.core.xla_model``, imported on first use (torch_xla is optional)."""
    return importlib.import_module("torch_xla.core.xla_model")


class XLASingleReplicaCollectives(SingleProcessCollectives):
    """World size 1 on XLA: local copies only, no collective in the graph.

    XLA tensors report ``data_ptr() == 0``, so the identity test of ``SingleProcessCollectives``
    cannot tell two tensors apart; copy unless they are the same tensor object (a copy on XLA is
    a lazy graph op, and XLA removes it when nothing reads the result).
    """

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        if output is not input:
            output.copy_(input.reshape(output.shape))
        return _finished(output)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        return self._all_gather(output, input)


class XLACollectives(Collectives):
    """Collectives among the XLA replicas of the job, or of one replica group.

    Args:
        rank, world_size: this replica's place in its group (the whole job: the global ordinal).
        groups: the replica groups, as global ordinals, when the collectives run within groups
            (hybrid sharding): every collective names every group (``groups=`` of torch_xla's
            collectives) and reduces or gathers within the one that holds this replica. None: one
            group of every replica.
        channel_ids: give every collective an explicit channel id (its position in the current
            graph) and unpinned layout. Needed where replicas are threads of one process that each
            compile their own copy of the graph (the XLA:CPU client): XLA:CPU matches the replicas
            of a collective by an op id that is the channel id when there is one, and otherwise an
            id that differs between separately compiled copies, so they would wait for each other
            forever. Numbering restarts whenever the graph is cut (a step closure registered with
            the graph's first collective), so every step traces the same ids and compiles once.
            TPUs run one program per process with pinned layouts and do not need this.
        process_replicas: how many replicas are threads of this process (XLA:CPU: the whole job).
    """

    def __init__(self, rank: int, world_size: int, channel_ids: bool = False,
                 groups: list[list[int]] | None = None, process_replicas: int = 1) -> None:
        super().__init__()
        #: replicas that are threads of this process (XLA:CPU: the job's world), which meet before a cut
        self.process_replicas = process_replicas
        self.rank = rank
        self.world_size = world_size
        self.channel_ids = channel_ids
        self.groups = [list(g) for g in groups] if groups is not None else None
        self._next_channel = 1
        self._xm = xla_model()

    def new_graph(self) -> None:
        """The traced graph was cut (torch_xla.sync / mark_step): restart the channel numbering."""
        self._next_channel = 1

    def _placement(self) -> dict[str, Any]:
        """Extra arguments of one all_gather / reduce_scatter call (see ``channel_ids``)."""
        if not self.channel_ids:
            return {} if self.groups is None else {"groups": self.groups}
        # one numbering per graph for every group's collectives (channel ids must not repeat in a
        # graph): the books' owner (the job's world collectives, see share_books) keeps it
        owner = self._books if isinstance(self._books, XLACollectives) else self
        channel = owner._next_channel
        if channel == 1:  # the first collective of this graph: renumber from 1 after the cut
            self._xm.add_step_closure(owner.new_graph)
        owner._next_channel += 1
        return {
            "groups": self.groups if self.groups is not None else [list(range(self.world_size))],
            "pin_layout": False,
            "channel_id": channel,
            "use_global_device_ids": True,
        }

    def _divide_if_avg(self, tensor: torch.Tensor, op: str) -> None:
        if op == "avg":
            tensor.div_(self.world_size)

    def _gather_flat(self, flat: torch.Tensor) -> torch.Tensor:
        return self._xm.all_gather(flat, dim=0, **self._placement())

    def _scatter_flat(self, flat: torch.Tensor, op: str) -> torch.Tensor:
        return self._xm.reduce_scatter(
            _XLA_REDUCE[op], flat, scale=1.0, scatter_dim=0, shard_count=self.world_size, **self._placement()
        )

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        output.copy_(self._gather_flat(input.reshape(-1)).view(output.shape))
        return _finished(output)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        output.copy_(self._scatter_flat(input.reshape(-1), op).view(output.shape))
        self._divide_if_avg(output, op)
        return _finished(output)

    def _reduced(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """``tensor`` reduced over all replicas (a new tensor)."""
        if not self.channel_ids:
            return self._xm.all_reduce(_XLA_REDUCE[op], tensor, groups=self.groups)
        # xm.all_reduce takes no channel id: gather every replica's copy and reduce it locally,
        # the same program on every replica, so the same result everywhere. One collective
        # instead of a reduce-scatter plus an all-gather; this path serves XLA:CPU testing only,
        # where the extra bytes cost nothing.
        stacked = self._gather_flat(tensor.reshape(-1)).view(self.world_size, -1)
        return _LOCAL_REDUCE[op](stacked).view(tensor.shape)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        tensor.copy_(self._reduced(tensor, op))
        self._divide_if_avg(tensor, op)
        return _finished(tensor)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        # A SUM all-reduce where every rank but ``src`` contributes zeros. ``torch.where`` rather
        # than a multiply by 0/1, so inf or NaN left in a receiving rank's buffer cannot leak in.
        is_src = torch.tensor(self.rank == src, device=tensor.device)
        contribution = torch.where(is_src, tensor, torch.zeros_like(tensor))
        tensor.copy_(self._reduced(contribution, "sum"))
        return _finished(tensor)

    def barrier(self) -> None:
        if not self.channel_ids:
            self._xm.rendezvous("xshard.barrier")
            return
        # xm.rendezvous is itself a collective without a channel id; wait on one of ours instead,
        # in a graph the replica threads compile together (see replica_threads)
        import torch_xla

        from . import replica_threads

        token = self._reduced(torch.zeros(1, device=torch_xla.device()), "sum")
        replica_threads.align(self.process_replicas)
        torch_xla.sync()
        token.cpu()
