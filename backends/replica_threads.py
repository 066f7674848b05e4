"""A barrier for replicas that are threads of one process (XLA:CPU), before each graph they cut.

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

