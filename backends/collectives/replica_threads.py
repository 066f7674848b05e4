"""Host-side meetings of replicas that are threads of one process (XLA:CPU): a barrier before each
graph they cut (``align``), and an exchange of bytes (``exchange``, torch_xla's ``rendezvous``).

On XLA:CPU every replica thread compiles its own copy of each new graph, then runs it; the first to
run waits in the graph's first collective for the others, and XLA:CPU ends the process when that
wait passes a fixed 10 seconds (no flag changes it in torch_xla 2.9). Replicas that reach the cut
at different moments start compiling apart by that much. Meeting here first (a host-side barrier,
no collective) makes them start compiling together, so the wait in the collective is only the
difference between two compiles of the same graph.

The barrier can never hang a job: a replica that raises under `xshard launch` ends the job's process
(the xla launcher's ``run_script``), and one that does not arrive within ``TIMEOUT_S`` (some code cut
a graph on one replica only, or a replica of a job started otherwise failed) breaks it; the waiting
replicas go on, and the barrier stays off for the rest of the process.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("xshard.backends")

#: how long a replica waits for the others at a graph cut before the barrier is given up
TIMEOUT_S = 300.0

_lock = threading.Lock()
_barrier: threading.Barrier | None = None
_off = False


def align(world_size: int) -> None:
    """Wait until every one of the process's ``world_size`` replica threads is here (see the module docstring)."""
    global _barrier, _off
    if world_size < 2 or _off:
        return
    with _lock:
        if _barrier is None or _barrier.parties != world_size:
            _barrier = threading.Barrier(world_size)
        barrier = _barrier
    try:
        barrier.wait(TIMEOUT_S)
    except threading.BrokenBarrierError:
        with _lock:
            if not _off:
                _off = True
                log.warning("xla: the replica threads did not all reach a graph cut within %.0f s (a replica "
                            "failed, or cut a graph alone); they no longer wait for each other there", TIMEOUT_S)


_exchange_lock = threading.Lock()
_exchange_barrier: threading.Barrier | None = None
_slots: dict[int, bytes] = {}


def exchange(world_size: int, index: int, payload: bytes) -> list[bytes]:
    """Every replica thread's ``payload``, in replica order (``index``: this replica's place).

    What torch_xla's ``rendezvous`` returns, exchanged on the host: its own version runs an all-gather
    without a channel id, which XLA:CPU's separately compiled copies never match (see
    ``XLACollectives.channel_ids``). Two barrier waits: all have written before anyone reads, and all
    have read before anyone writes the next exchange's payload. A replica missing for ``TIMEOUT_S``
    raises here (the exchange cannot return without its payload).
    """
    global _exchange_barrier
    if world_size < 2:
        return [payload]
    with _exchange_lock:
        if _exchange_barrier is None or _exchange_barrier.parties != world_size:
            _exchange_barrier = threading.Barrier(world_size)
        barrier = _exchange_barrier
        _slots[index] = payload
    try:
        barrier.wait(TIMEOUT_S)
        with _exchange_lock:
            payloads = [_slots[i] for i in range(world_size)]
        barrier.wait(TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise RuntimeError(
            f"xla: replica {index} waited {TIMEOUT_S:.0f} s in a rendezvous (xm.rendezvous / xm.mesh_reduce) for "
            f"the other {world_size - 1} replica thread(s); every replica must call it, in the same order"
        ) from None
    return payloads
