"""The collectives agreement check off the training path: ranks that start issuing different collectives after
the first optimizer step (a branch taken by the data, some steps in) still get, on every rank and within
seconds, a ``CollectiveMismatchError`` naming the step and the first collective where they differ.

The first step is checked at once, blocking (tests/test_semantics_users.py: a branch taken by the rank is
named before any update); every later one by the collective monitor's thread through the job's store
(``backends/collectives/agreement.py``), which reads no device value in the step (tests/test_no_host_reads.py).
"""

from __future__ import annotations

import time

import pytest
import torch
from support.distributed import run_workers
from torch import nn

pytestmark = pytest.mark.multiprocess

DIVERGE_AT = 5  # the first optimizer step in which rank 1 takes the other branch
#: how long a rank waits after its error before it ends: a script's exception hook waits for its peers'
#: flight records (``FLIGHT_ANSWER_WAIT_S``), time in which a peer's monitor reads the same message
EXIT_AFTER_S = 3.0


class TwoWays(nn.Module):
    """Two units of the same shape: ranks that take different ones issue collectives gloo cannot tell apart."""

    _no_split_modules = ["Linear"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.left = nn.Linear(6, 6)
        self.right = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, go_left: bool) -> torch.Tensor:
        h = self.inp(x)
        return (self.left(h) if go_left else self.right(h)).sum(-1)


def _worker(rank: int, world_size: int, stage: int, timeout: float, prefetch: bool = True) -> dict:
    import logging

    from xshard.backends import get_backend
    from xshard.errors import CollectiveMismatchError
    from xshard.sharding import ShardingOptions, shard_model

    said: list[tuple[float, str]] = []  # what the monitor logged, and when
    handler = logging.Handler()
    handler.emit = lambda record: said.append((time.monotonic(), record.getMessage()))  # type: ignore[method-assign]
    handler.setLevel(logging.ERROR)
    logging.getLogger("xshard.backends").addHandler(handler)
    backend = get_backend("cpu")
    backend.init_process_group(timeout=timeout)
    torch.manual_seed(0)
    options = ShardingOptions(stage=stage, auto_wrap_policy="transformer")
    if not prefetch:  # each rank gathers what it runs, when it runs it: same sizes, same order
        options = ShardingOptions(stage=stage, auto_wrap_policy="transformer", forward_prefetch=False,
                                  backward_prefetch="none")
    model = shard_model(TwoWays(), backend, options)
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
            model(x, go_left=rank == 0 or step < DIVERGE_AT).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
    except CollectiveMismatchError as exc:
        start = diverged_at or time.monotonic()
        named = [t - start for t, text in said if "ranks issued different collectives" in text]
        time.sleep(EXIT_AFTER_S)
        return {"error": str(exc), "seconds": time.monotonic() - EXIT_AFTER_S - start, "steps": step,
                "named_after": named[0] if named else None}
    backend.destroy_process_group()
    return {"steps": step}


def test_a_mismatch_after_the_first_step_is_named_on_every_rank_within_seconds() -> None:
    # without prefetching, the units' collectives come in the same order with the same sizes: the ranks would
    # train on, mixing their gradients
    results = run_workers(_worker, 2, 3, 60.0, False, timeout=120)
    for rank, r in enumerate(results):
        assert "error" in r, f"rank {rank} trained {r['steps']} steps on although the ranks ran different units"
        assert r["seconds"] < 15
        message = r["error"]
        assert f"optimizer step {DIVERGE_AT}:" in message, message
        assert "unit left" in message and "unit right" in message, message
        assert "rank 0" in message and "rank 1" in message and "summon_full_params" in message


def test_ranks_hung_in_different_collectives_are_named_within_seconds() -> None:
    # stage 3: rank 0 reduce-scatters a unit's gradients while rank 1 gathers the next unit (its prefetch
    # follows the other branch): both wait for good. Named seconds into the wait, raised when it times out
    timeout = 10.0
    results = run_workers(_worker, 2, 3, timeout, timeout=120)
    for rank, r in enumerate(results):
        assert "error" in r, f"rank {rank} trained {r['steps']} steps on although the ranks ran different units"
        assert r["named_after"] is not None and r["named_after"] < 10, r
        message = r["error"]
        assert "ranks issued different collectives: at collective #" in message, message
        assert "unit right" in message and "rank 0" in message and "rank 1" in message, message
        assert "summon_full_params" in message
