"""Ranks whose collectives differ are named on every rank within seconds, whatever the process group's timeout.

- the agreement check off the training path: ranks that start issuing different collectives after the first
  optimizer step (code that differs by rank, some steps in, all-reducing different values of the same size:
  gloo completes every collective, and the ranks would train on, mixing their values)
  still get, on every rank and within seconds, a ``CollectiveMismatchError`` naming the step and the first
  collective where they differ (``backends/collectives/agreement.py``). The first step is checked at once,
  blocking (tests/test_semantics_users.py); every later one by the collective monitor's thread through the
  job's store, which reads no device value in the step (tests/test_no_host_reads.py);
- ranks stuck in collectives that cannot complete each other (a collective of the script's own issued on one
  rank only; a unit called twice on one rank) under the default timeout of 30 minutes: the monitor names the
  mismatch on every rank seconds into the wait, with every rank's collective and the line of the user's code
  each waits from (``backends/diagnostics/monitor.py``), not at the timeout.

The stuck ranks' waits would last the whole timeout: each worker trains in a thread of its own, its main thread
returns what its log said once the mismatch was named, and the process then ends (``_end_soon``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from support.distributed import run_workers
from torch import nn

from xshard.config.schema import XShardConfig

pytestmark = pytest.mark.multiprocess

DIVERGE_AT = 5  # the first optimizer step in which rank 1 does something else
#: how long a rank waits after its error before it ends: a script's exception hook waits for its peers'
#: flight records (``FLIGHT_ANSWER_WAIT_S``), time in which a peer's monitor reads the same message
EXIT_AFTER_S = 3.0
#: the process group's timeout when a script sets none (30 minutes)
DEFAULT_TIMEOUT = XShardConfig().timeout
NAMED = "ranks issued different collectives"
THIS_FILE = Path(__file__).name


def _line(marker: str) -> int:
    """The line of this file that holds ``# <marker>`` (where a test's offending call is)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# <{marker}>"))


class Twice(nn.Module):
    """A model that calls its unit ``mid`` twice on rank 1 from step ``DIVERGE_AT``, once elsewhere."""

    _no_split_modules = ["Linear"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, twice: bool) -> torch.Tensor:
        h = self.mid(self.inp(x))  # <mid once>
        if twice:
            h = self.mid(h)  # <mid twice>
        return self.out(h).sum(-1)  # <out>


def _log_records() -> list[tuple[float, str]]:
    """What the monitor logs from now on, with when (``time.monotonic``)."""
    import logging

    said: list[tuple[float, str]] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append((time.monotonic(), record.getMessage()))  # type: ignore[method-assign]
    handler.setLevel(logging.ERROR)
    logging.getLogger("xshard.backends").addHandler(handler)
    return said


def _agreement_worker(rank: int, world_size: int) -> dict:
    from xshard.backends import get_backend
    from xshard.errors import CollectiveMismatchError
    from xshard.sharding import ShardingOptions, shard_model

    said = _log_records()
    backend = get_backend("cpu")
    backend.init_process_group(timeout=60.0)
    torch.manual_seed(0)
    options = ShardingOptions(stage=3, auto_wrap_policy="transformer")
    model = shard_model(Twice(), backend, options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.register_optimizer(opt)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    diverged_at: float | None = None
    step = 0
    try:
        while diverged_at is None or time.monotonic() - diverged_at < 30:
            step += 1
            if step == DIVERGE_AT:
                diverged_at = time.monotonic()
            loss = model(x, twice=False).pow(2).mean()
            # from step 5 the ranks sum different things of the same size (code that differs by rank): every
            # all-reduce completes, yet rank 0 adds its loss to rank 1's accuracy
            what = "loss" if rank == 0 or step < DIVERGE_AT else "accuracy"
            backend.collectives.all_reduce(loss.detach().reshape(1), op="sum", tag=f"all-reduce of the {what}")
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
    except CollectiveMismatchError as exc:
        start = diverged_at or time.monotonic()
        named = [t - start for t, text in said if NAMED in text]
        time.sleep(EXIT_AFTER_S)
        return {"error": str(exc), "seconds": time.monotonic() - EXIT_AFTER_S - start, "steps": step,
                "named_after": named[0] if named else None}
    backend.destroy_process_group()
    return {"steps": step}


def test_a_mismatch_after_the_first_step_is_named_on_every_rank_within_seconds() -> None:
    results = run_workers(_agreement_worker, 2, timeout=120)
    for rank, r in enumerate(results):
        assert "error" in r, f"rank {rank} trained {r['steps']} steps on although its units ran in another order"
        assert r["seconds"] < 15, r
        message = r["error"]
        assert f"optimizer step {DIVERGE_AT}:" in message, message
        assert "'all-reduce of the loss (1 elements)'" in message, message
        assert "'all-reduce of the accuracy (1 elements)'" in message, message
        assert "rank 0" in message and "rank 1" in message and "summon_full_params" in message


# ---------------------------------------------------------------------- stuck under the default timeout


def _end_soon() -> None:
    """End this process ``EXIT_AFTER_S`` from now, whatever its threads do then: its training thread waits in a
    collective that completes only at the timeout, and leaving the process group could wait for it too. The
    worker's result is saved by then (``support.distributed``), and the exit code is 0."""
    timer = threading.Timer(EXIT_AFTER_S, os._exit, (0,))
    timer.daemon = True
    timer.start()


def _stuck_worker(rank: int, world_size: int, case: str) -> dict:
    from xshard.backends import get_backend
    from xshard.sharding import ShardingOptions, shard_model

    said = _log_records()
    backend = get_backend("cpu")
    backend.init_process_group(timeout=DEFAULT_TIMEOUT)
    torch.manual_seed(0)
    model = shard_model(Twice(), backend, ShardingOptions(stage=3, auto_wrap_policy="transformer"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.register_optimizer(opt)
    collectives = backend.collectives
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    box: dict = {}

    def train() -> None:
        try:
            for step in range(1, 1000):
                if step == DIVERGE_AT:
                    box["diverged_at"] = time.monotonic()
                    if case == "own collective" and rank == 1:  # as under `if accelerator.is_main_process:`
                        collectives.all_reduce(torch.ones(3), op="sum")  # <own collective>
                twice = case == "unit twice" and rank == 1 and step >= DIVERGE_AT
                model(x, twice=twice).pow(2).mean().backward()  # <backward>
                opt.step()
                opt.zero_grad()
            box["steps"] = step
        except BaseException as exc:  # a rank whose peer ended: its wait fails
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=train, name="training", daemon=True)
    thread.start()
    deadline = time.monotonic() + 90
    while thread.is_alive() and time.monotonic() < deadline and not any(NAMED in text for _, text in said):
        time.sleep(0.05)
    named = [(t, text) for t, text in said if NAMED in text]
    _end_soon()
    start = box.get("diverged_at")
    return {"named_after": named[0][0] - start if named and start else None,
            "message": named[0][1] if named else None, "timeout": collectives.monitor.timeout,
            "trained_on": box.get("steps"), "error": box.get("error")}


def _places(message: str) -> dict[int, tuple[str, str, int, str]]:
    """Each rank's place as the message names it: rank -> (its collective, the file, the line, the function)."""
    found = re.findall(r"rank (\d+) at #\d+ '([^']+)', waiting in it, from (\S+):(\d+) in (\w+)", message)
    return {int(r): (what, Path(file).name, int(line), function) for r, what, file, line, function in found}


def _assert_named_on_every_rank(results: list[dict]) -> list[str]:
    messages = []
    for rank, r in enumerate(results):
        assert r["timeout"] == DEFAULT_TIMEOUT == 1800.0, r
        assert r["message"] is not None, f"rank {rank}: the mismatch was not named ({r})"
        assert r["named_after"] < 10, r
        message = r["message"]
        assert "ranks issued different collectives: at collective #" in message, message
        assert "Where each rank is: " in message and "summon_full_params" in message, message
        places = _places(message)
        assert sorted(places) == [0, 1], message  # every rank, with the line of this file it waits from
        lines = {_line(marker) for marker in ("own collective", "mid once", "mid twice", "out", "backward")}
        assert all(file == THIS_FILE and line in lines for _, file, line, _ in places.values()), message
        messages.append(message)
    return messages


def test_a_collective_of_the_scripts_own_on_one_rank_is_named_on_every_rank_within_seconds() -> None:
    # rank 1 all-reduces a tensor of its own at step 5 (code under `if accelerator.is_main_process:`) while rank 0
    # gathers the model's first unit: neither completes before the timeout, 30 minutes on
    results = run_workers(_stuck_worker, 2, "own collective", timeout=150)
    for message in _assert_named_on_every_rank(results):
        places = _places(message)
        assert places[1] == ("all_reduce", THIS_FILE, _line("own collective"), "train"), message
        assert places[0] == ("all-gather of unit inp", THIS_FILE, _line("mid once"), "forward"), message


def test_a_unit_called_twice_on_one_rank_is_named_on_every_rank_within_seconds() -> None:
    # from step 5 rank 1 calls unit mid twice: its collectives run one ahead of rank 0's, which pair up with
    # others (same sizes) until two of different kinds meet, in the backward
    results = run_workers(_stuck_worker, 2, "unit twice", timeout=150)
    for message in _assert_named_on_every_rank(results):
        places = _places(message)
        assert all(" of unit " in what for what, _, _, _ in places.values()), message
