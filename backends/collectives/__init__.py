"""Collectives: all_gather / reduce_scatter / all_reduce / broadcast / barrier, with a byte counter.

Three implementations share one interface (``Collectives``):
- ``DistCollectives``: torch.distributed (gloo, nccl, hccl). Options choose, per operation, the fastest
  way a process group can do the job (gloo's own reduce-scatter and all-gather are slow; see
  ``backends/devices/cpu.py`` and ``benchmarks/collectives_gloo.py``).
- ``SingleProcessCollectives``: world size 1; every call is a local copy or nothing.
- torch_xla's, in ``backends/collectives/xla_graph.py``.

One job per file:

- ``interface.py``: ``Collectives``, the typed front the sharded core calls (argument checks, averages,
  subgroups sharing the job's books, the default packing of the list forms)
- ``handle.py``: ``Handle``, an operation in flight, and ``IN_FLIGHT``, how many this process handed out
- ``accounting.py``: ``CommCounter``, bytes and calls per kind (the ZeRO paper's byte convention)
- ``trace.py``: ``CollectiveTrace``, the numbered fingerprint of what was issued, and ``describe_mismatch``
- ``agreement.py``: ``CollectiveAgreement``, the ranks' traces compared after the first optimizer step on the
  collective monitor's thread, through the job's store (no device read in a training step)
- ``single.py``: ``SingleProcessCollectives``
- ``process_group.py``: ``DistCollectives`` (gloo's packing of small tensors, the reduce-scatter forms)
"""

from __future__ import annotations

from .accounting import CommCounter
from .handle import IN_FLIGHT, Handle, InFlight, Output
from .interface import REDUCE_OPS, Collectives, average_factors
from .process_group import PACK_BELOW_BYTES, REDUCE_SCATTER_FORMS, DistCollectives, ReduceScatterForm
from .single import SingleProcessCollectives
from .trace import CollectiveTrace, describe_mismatch

__all__ = ["IN_FLIGHT", "PACK_BELOW_BYTES", "REDUCE_OPS", "REDUCE_SCATTER_FORMS", "CollectiveTrace", "Collectives",
           "CommCounter", "DistCollectives", "Handle", "InFlight", "Output", "ReduceScatterForm",
           "SingleProcessCollectives", "average_factors", "describe_mismatch"]
