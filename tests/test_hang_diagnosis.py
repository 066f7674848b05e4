"""A rank that stops before a collective: the others fail within the timeout, naming the rank that never came.

Rank 1 gets stuck in its own code (as in a deadlocked data loader) after its first step; rank 0 goes on
into the next step's collectives. With ``XSHARD_TIMEOUT=6`` rank 0 raises ``CollectiveTimeoutError``
within seconds of the timeout, and the message says that rank 1 never arrived, what rank 1 did last
and which collective rank 0 waits in (not the process group's "rank 0 timed out").
"""

from __future__ import annotations

import time

import pytest
from distributed import run_workers

pytestmark = pytest.mark.multiprocess


def _stuck_worker(rank: int, world: int) -> dict:
    import torch
    from xshard.backends.errors import CollectiveTimeoutError

    import xshard

    acc = xshard.Accelerator(stage=3, seed=0, auto_wrap_policy="size", min_num_params=50)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 8)
    acc.backward(model(x).pow(2).mean())
    opt.step()
    if rank == 1:
        time.sleep(20)  # stuck in its own code; never reaches the next collective
        return {"stuck": True}
    start = time.monotonic()
    try:
        acc.backward(model(x).pow(2).mean())
    except CollectiveTimeoutError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


def test_a_rank_that_never_arrives_is_named_within_the_timeout() -> None:
    results = run_workers(_stuck_worker, 2, env={"XSHARD_TIMEOUT": "6"}, timeout=120)
    message = results[0]["error"]
    assert message is not None, "rank 0 went on although rank 1 never arrived"
    assert results[0]["seconds"] < 15
    assert "never arrived" in message and "rank 1 (its last collective is #" in message
    assert "all-gather of unit" in message  # what rank 0 waits in
