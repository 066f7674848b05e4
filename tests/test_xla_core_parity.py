"""The sharded core on real torch_xla matches the CPU backend and torch_xla's own FSDP.

- 2 XLA:CPU replicas (torch_xla's launcher, see ``xla_replicas``) at stages 0 and 3 train like one
  CPU process on the full batch: losses, every step's gradient norms (a wrong average moves them,
  not AdamW's losses) and full parameters after K steps; so do 4 replicas with hybrid sharding (2
  shard groups of 2, torch_xla's replica groups).
- One XLA device: the core at stage 3 matches XlaFullyShardedDataParallel with its transformer
  auto-wrap policy, with and without ``checkpoint_module`` (xla_fsdp_grad_ckpt).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from support.xla_core_runs import (  # noqa: E402
    assemble_shards,
    build_tiny,
    train_core_on_xla,
    train_on_cpu_backend,
    train_xla_fsdp,
)
from support.xla_replicas import run_replicas  # noqa: E402

pytestmark = pytest.mark.xla
# The PJRT runtime must start before this process runs its first backward (the CPU reference's):
# torch's autograd engine sizes its device queues then (see XLABackend.__init__).
xr.world_size()

STEPS = 4
ATOL = 1e-5


def run_two_replicas(*args):
    """``train_core_on_xla`` on 2 replicas (one run, see ``run_replicas``)."""
    return run_replicas(train_core_on_xla, 2, *args, timeout=240)


def assert_same_gradients(group: list[dict], reference: dict, replicated: bool) -> None:
    """Each step's per-parameter gradient norm, from one shard group's replicas (their rows' squares
    added; ``replicated``: stage 0, where every replica holds the whole gradient), equals the
    reference's within 1e-4 relative (fp32 sums in another order)."""
    assert len(group[0]["grads"]) == len(reference["grads"])
    for step, theirs in enumerate(reference["grads"]):
        for res in group:
            assert set(res["grads"][step]) == set(theirs), step
        for name, b in theirs.items():
            a = group[0]["grads"][step][name] if replicated else sum(r["grads"][step][name] for r in group)
            assert abs(a ** 0.5 - b ** 0.5) <= 1e-6 + 1e-4 * b ** 0.5, (
                f"step {step}: gradient norm of {name} {a ** 0.5} vs reference {b ** 0.5}")


def assert_same_state(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(state) <= set(reference) and len(state) >= len(reference) - 1  # the tied head may be folded
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("stage,checkpointing,step_with_xm", [
    (0, False, False), (3, True, True)],
    ids=["stage0", "stage3-ckpt-xm.optimizer_step"])
def test_two_xla_replicas_train_like_one_cpu_process(stage: int, checkpointing: bool, step_with_xm: bool) -> None:
    reference = train_on_cpu_backend(stage, STEPS, checkpointing)
    results = run_two_replicas(stage, STEPS, checkpointing, step_with_xm)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(reference["losses"]), atol=ATOL, rtol=0)
    assert_same_gradients(results, reference, replicated=stage == 0)
    assert_same_state(assemble_shards(results, reference["state"]), reference["state"])
    for res in results:
        assert res["params_kept"]  # the optimizer built before sharding stepped the user's Parameters
        # one training step is one graph: after the warm-up steps (Adam's first step traces no
        # state yet), every further step reuses the compiled graphs
        assert res["compiles"][1] == res["compiles"][-1], res["compiles"]
        assert res["xm_all_reduce_calls"] == 0  # the core's gradients never go through xm's all-reduce
        # xm.optimizer_step is patched while a sharded (stage >= 1) model lives, and back after close()
        assert (res["patched"], res["restored"]) == (stage >= 1, True)


def test_hybrid_sharding_on_four_xla_replicas_trains_like_one_cpu_process() -> None:
    """2 shard groups of 2 replicas (torch_xla replica groups): gathers and reduce-scatters within
    [0 1] and [2 3], the reduced shards averaged across [0 2] and [1 3]."""
    reference = train_on_cpu_backend(3, STEPS)
    results = run_replicas(train_core_on_xla, 4, 3, STEPS, False, False, {"shard_group_size": 2}, timeout=270)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(reference["losses"]), atol=ATOL, rtol=0)
    assert_same_gradients(results[:2], reference, replicated=False)
    assert_same_gradients(results[2:], reference, replicated=False)
    assert_same_state(assemble_shards(results[:2], reference["state"]), reference["state"])
    for twin, res in zip(results[:2], results[2:], strict=True):  # the second replica holds the same rows
        assert all(torch.equal(res["shards"][k], v) for k, v in twin["shards"].items())
    for res in results:
        # (broadcast_inter: the replicas take the first replica's shards once, when the model is sharded)
        assert set(res["comm"]["bytes"]) == {"all_gather", "reduce_scatter", "all_reduce_inter", "broadcast_inter"}
        assert res["compiles"][1] == res["compiles"][-1], res["compiles"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpoint_module"])
def test_core_matches_xla_fsdp_on_one_device(checkpointing: bool) -> None:
    theirs = train_xla_fsdp(STEPS, checkpointing)
    ours = train_core_on_xla(0, 1, 3, STEPS, checkpointing)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), atol=ATOL, rtol=0)
    assert_same_state(theirs["state"], assemble_shards([ours], build_tiny().state_dict()))
    # checkpointed blocks run their layers again in backward (3 blocks: 3 calls a step, 6 recomputed)
    assert ours["up_calls"] == theirs["up_calls"] == [6 if checkpointing else 3] * STEPS
    assert ours["compiles"][1] == ours["compiles"][-1], ours["compiles"]  # nothing new after warm-up
