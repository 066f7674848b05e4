"""A rank that stops before a collective: the others fail within the timeout, naming the rank that never came.

Rank 1 gets stuck in its own code (as in a deadlocked data loader) after its first step; rank 0 goes on
into the next step's collectives. With ``XSHARD_TIMEOUT=6`` rank 0 raises ``CollectiveTimeoutError``
within seconds of the timeout, and the message says that rank 1 never arrived, what rank 1 did last
and which collective rank 0 waits in (not the process group's "rank 0 timed out").
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess


def _stay_away(out: str, seconds: float) -> None:
    """The stuck rank's own code: it stays away until the waiting rank has its error (``_done``), at most
    ``seconds`` (longer than the timeout), so that the test takes as long as the diagnosis, not the cap."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (Path(out) / "done").exists():
        time.sleep(0.1)


def _done(out: str) -> None:
    (Path(out) / "done").touch()


def _stuck_worker(rank: int, world: int, out: str) -> dict:
    import torch

    import xshard
    from xshard.errors import CollectiveTimeoutError

    acc = xshard.Accelerator(stage=3, seed=0, auto_wrap_policy="size", min_num_params=50)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 8)
    acc.backward(model(x).pow(2).mean())
    opt.step()
    if rank == 1:
        _stay_away(out, 20)  # stuck in its own code; never reaches the next collective
        return {"stuck": True}
    start = time.monotonic()
    try:
        acc.backward(model(x).pow(2).mean())
    except CollectiveTimeoutError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    finally:
        _done(out)
    return {"error": None}


def test_a_rank_that_never_arrives_is_named_within_the_timeout(tmp_path) -> None:
    results = run_workers(_stuck_worker, 2, str(tmp_path), env={"XSHARD_TIMEOUT": "6"}, timeout=120)
    message = results[0]["error"]
    assert message is not None, "rank 0 went on although rank 1 never arrived"
    assert results[0]["seconds"] < 15
    assert "never arrived" in message and "rank 1 (its last collective is #" in message
    assert "all-gather of unit" in message  # what rank 0 waits in


# ---------------------------------------------------------------------- barriers and dead peers


def _barrier_worker(rank: int, world: int, where: str, out: str) -> dict:
    import torch

    import xshard
    from xshard.errors import XShardError

    acc = xshard.Accelerator(stage=3, seed=0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.wait_for_everyone()
    stuck = 1 if where != "main_process_first" else 0
    start = time.monotonic()
    try:
        if rank == stuck and where != "main_process_first":
            _stay_away(out, 10)  # stuck in its own code before the barrier
            return {"stuck": True}
        if where == "wait_for_everyone":
            acc.wait_for_everyone()
        elif where == "main_process_first":
            with acc.main_process_first():
                if rank == 0:
                    _stay_away(out, 10)  # rank 0 "downloads" for longer than the timeout; the others wait
        elif where == "save_state":
            acc.save_state(f"{out}/checkpoint-1")
    except XShardError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    finally:
        if rank != stuck:
            _done(out)
    return {"error": None}


@pytest.mark.parametrize("where", ["wait_for_everyone", "main_process_first", "save_state"])
def test_a_rank_that_never_reaches_a_barrier_is_named(where, tmp_path) -> None:
    results = run_workers(_barrier_worker, 2, where, str(tmp_path), env={"XSHARD_TIMEOUT": "6"}, timeout=120)
    stuck = 0 if where == "main_process_first" else 1
    waiter = 1 - stuck
    message = results[waiter]["error"]
    assert message is not None, f"rank {waiter} went on although rank {stuck} never arrived"
    assert message.startswith("CollectiveTimeoutError") and results[waiter]["seconds"] < 15
    assert f"These ranks never arrived: rank {stuck} (its last collective is #" in message
    assert "(barrier)" in message or where == "save_state"
    assert f"rank {waiter} (" not in message  # a rank never lists itself


def _killed_peer_worker(rank: int, world: int, victim: int) -> dict:
    import os
    import signal

    import torch

    import xshard
    from xshard.errors import XShardError

    acc = xshard.Accelerator(stage=3, seed=0, auto_wrap_policy="size", min_num_params=50)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 8)
    acc.backward(model(x).pow(2).mean())
    opt.step()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, kill -9
    start = time.monotonic()
    try:
        for _ in range(3):
            acc.backward(model(x).pow(2).mean())
            opt.step()
        acc.wait_for_everyone()
    except XShardError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("victim", [1, 0], ids=["rank 1", "rank 0, which holds the store"])
def test_a_killed_peer_is_named_as_dead_not_as_a_timeout(tmp_path, victim) -> None:
    # run_workers stops every rank once one exits; here the survivor must outlive the killed rank
    import torch
    from support.distributed import CONTEXT, _entry, free_port

    port = free_port()
    procs = [CONTEXT.Process(target=_entry, args=(r, _killed_peer_worker, 2, port, str(tmp_path),
                                                  {"XSHARD_TIMEOUT": "30"}, (victim,), 120, dict(os.environ)))
             for r in range(2)]
    for p in procs:
        p.start()
    survivor = 1 - victim
    procs[survivor].join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    assert procs[victim].exitcode == -9
    result = torch.load(tmp_path / f"rank{survivor}.pt", weights_only=False)
    assert result["ok"], result.get("error")
    message = result["result"]["error"]
    assert message is not None and message.startswith("RankDiedError"), message
    if victim == 1:
        assert "rank 1 died (process " in message
    else:  # rank 0's process held the job's store (no launcher here): its death takes the store too
        assert "the process that holds the job's key-value store" in message and "died" in message
    assert "timed out" not in message.split("(the process group")[0]
    assert "never arrived" not in message and f"rank {survivor} (" not in message
    assert result["result"]["seconds"] < 20  # named at once (the timeout is 30 s)
