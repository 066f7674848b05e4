"""Full state dicts, sync_module_states, eval forward, and the sharded fp16 grad scaler (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.models import batch, make_qwen2, make_tiny

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, world: int) -> dict:
    """Both checks in one job (process start-up dominates the cost)."""
    from support.sharding_harness import init_backend

    backend = init_backend()
    out = {"state": _state_checks(backend, rank), "scaler": _scaler_checks(backend, rank)}
    backend.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


def _state_checks(backend, rank: int) -> dict:
    from xshard.sharding import ShardingOptions, shard_model

    out: dict = {}
    ids, _ = batch(0, 4)
    for stage in (0, 1, 2, 3):
        # the gathered state dict is the model's own (keys, values), and loading one takes effect
        sm = shard_model(make_tiny(), backend, ShardingOptions(stage=stage))
        out[("full", stage)] = sm.full_state_dict()
        other = make_tiny(seed=7).state_dict()
        sm.load_full_state_dict(other)
        out[("reloaded", stage)] = sm.full_state_dict(rank0_only=False)
        with torch.no_grad():
            out[("logits_after_load", stage)] = sm(ids)
        out[("unsharded_after_eval", stage)] = sm.stats()["state_bytes"]["unsharded_params"]
        # sync_module_states: every rank starts from rank 0's values
        synced = shard_model(make_tiny(seed=100 + rank), backend, ShardingOptions(stage=stage, sync_module_states=True))
        out[("synced", stage)] = synced.full_state_dict(rank0_only=False)
    qwen = shard_model(make_qwen2(), backend, ShardingOptions(stage=3))
    out["qwen"] = qwen.full_state_dict()
    try:
        sm.load_full_state_dict({"nope": torch.zeros(1)})
    except KeyError as exc:
        out["bad_load"] = str(exc)
    return out


def test_full_state_dict_load_and_sync(results, tmp_path) -> None:
    results = [r["state"] for r in results]
    reference = make_tiny().state_dict()
    other = make_tiny(seed=7)
    with torch.no_grad():
        other_logits = other(batch(0, 4)[0])
    for rank, res in enumerate(results):
        for stage in range(4):
            full = res[("full", stage)]
            if rank == 0:
                assert list(full) == list(reference)  # keys exactly as module.state_dict(), tied ones included
                for k, v in reference.items():
                    assert full[k].device.type == "cpu"
                    torch.testing.assert_close(full[k], v, atol=0, rtol=0)
            else:
                assert full == {}  # rank0_only
            for k, v in other.state_dict().items():
                torch.testing.assert_close(res[("reloaded", stage)][k], v, atol=0, rtol=0)
            torch.testing.assert_close(res[("logits_after_load", stage)], other_logits, atol=1e-5, rtol=0)
            if stage == 3:
                assert res[("unsharded_after_eval", stage)] == 0  # no_grad forward frees every unit
            for k, v in make_tiny(seed=100).state_dict().items():
                torch.testing.assert_close(res[("synced", stage)][k], v, atol=0, rtol=0)
    # a Hugging Face model takes the gathered dict as is
    fresh = make_qwen2(seed=3)
    fresh.load_state_dict(results[0]["qwen"], strict=True)
    for k, v in make_qwen2().state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, atol=0, rtol=0)
    assert "missing keys" in results[0]["bad_load"] and "nope" in results[0]["bad_load"]
    # ... and save_pretrained writes it, from_pretrained reads it back
    from transformers import Qwen2ForCausalLM

    fresh.save_pretrained(tmp_path, state_dict=results[0]["qwen"])
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path)
    for k, v in make_qwen2().state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0)


def _scaler_checks(backend, rank: int) -> dict:
    from xshard.sharding import ShardedGradScaler, ShardingOptions, shard_model

    sm = shard_model(make_tiny(), backend, ShardingOptions(stage=3))
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    scaler = ShardedGradScaler.for_backend(backend, init_scale=1024.0)
    out = {}
    ids, labels = batch(0, 4)
    for step in range(2):
        before = [p.detach().clone() for p in sm.parameters()]
        scaler.scale(sm(ids, labels)).backward()
        if step == 0 and rank == 1:  # an overflow on one rank only
            next(p for p in sm.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out[step] = {"changed": any(not torch.equal(b, p) for b, p in zip(before, sm.parameters(), strict=True)),
                     "scale": scaler.get_scale()}
    return out


def test_sharded_grad_scaler_skips_the_step_on_every_rank(results) -> None:
    for res in (r["scaler"] for r in results):
        assert res[0] == {"changed": False, "scale": 512.0}  # skipped everywhere, scale backed off
        assert res[1]["changed"] and res[1]["scale"] == 512.0
