"""Bytes sent per step and model-state bytes per rank, against the ZeRO formulas.

psi (communication) = bytes of the parameters in the communication dtype, padded to dim-0 shards:
for a parameter of shape (d0, *rest), N * ceil(d0 / N) * prod(rest) elements. The formulas
implemented (and asserted here) per training step, at steady state (shards changed by the
previous optimizer step):
- stage 0: all-reduce of the trainable gradients: 2 psi_trainable (unpadded; all-reduce counts twice);
- stages 1-2: one all-gather of psi plus one reduce-scatter of psi_trainable: 2 psi without frozen params
  (the first step too: the compute copies are built from the gathered shards, so ranks agree);
- stage 3: every non-root unit is gathered twice (forward and backward), the root unit once (it stays
  gathered from its forward to the end of backward, as in PyTorch FSDP2), plus the reduce-scatter:
  3 psi - psi_root.
Frozen parameters are gathered but never reduced. Every reduce also carries one "had a gradient" flag
per trainable parameter (so that a parameter no rank used keeps ``grad is None``): ``flag_bytes``.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.distributed import run_workers
from support.models import batch, make_tiny

pytestmark = pytest.mark.multiprocess

ROOT = ("embed.weight", "norm.weight", "norm.bias", "logit_scale")  # TinyLM's root unit (tied head lives in it)


def psi_bytes(model: torch.nn.Module, world: int, names=None, trainable_only=False, padded=True, elem=4) -> int:
    """Parameter bytes (``elem`` bytes each), padded to ``world`` dim-0 shards unless ``padded=False``."""
    total = 0
    for name, p in model.named_parameters():
        if names is not None and name not in names:
            continue
        if trainable_only and not p.requires_grad:
            continue
        d0 = p.shape[0] if p.dim() else 1
        row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        total += (world * -(-d0 // world) * row if padded else d0 * row) * elem
    return total


def flag_bytes(model: torch.nn.Module, world: int, kind: str, elem: int = 4) -> int:
    """Bytes of the used-parameter flags in one step's reduce: one element per trainable parameter,
    counted twice by an all-reduce and once per rank's slice by a reduce-scatter."""
    n = sum(1 for p in dict.fromkeys(model.parameters()) if p.requires_grad)
    return n * elem * (2 if kind == "all_reduce" else world)


def _freeze(model: torch.nn.Module) -> None:
    model.blocks[0].up.weight.requires_grad_(False)
    model.blocks[1].norm.weight.requires_grad_(False)


def _account(rank: int, world: int) -> dict:
    from support.sharding_harness import init_backend

    from xshard.sharding import ShardingOptions, shard_model

    backend = init_backend()
    out: dict = {}
    per = 8 // world
    for stage in (0, 1, 2, 3):
        for frozen in (False, True):
            model = make_tiny()
            if frozen:
                _freeze(model)
            sm = shard_model(model, backend, ShardingOptions(stage=stage))
            opt = torch.optim.AdamW([p for p in sm.parameters() if p.requires_grad], lr=1e-2)
            sm.register_optimizer(opt)
            comm = []
            for step in range(3):
                ids, labels = batch(step, 8)
                sl = slice(rank * per, (rank + 1) * per)
                sm.reset_stats()
                if step == 2:  # a no_sync micro-step first: no reduce traffic at all
                    with sm.no_sync():
                        sm(ids[sl], labels[sl]).backward()
                    out[(stage, frozen, "no_sync")] = sm.stats()["comm"]["bytes"]
                    sm.reset_stats()
                sm(ids[sl], labels[sl]).backward()
                comm.append(sm.stats()["comm"]["bytes"])
                opt.step()
                if step == 2:
                    # frozen parameters: no gradient, no full gradient, no optimizer state
                    frozen_params = [p for p in sm.parameters() if not p.requires_grad]
                    out[(stage, frozen, "frozen_grads")] = [p.grad is None for p in frozen_params]
                    out[(stage, frozen, "frozen_state")] = [p in opt.state for p in frozen_params]
                    out[(stage, frozen, "full_grads")] = [
                        sp.full.grad is None for u in sm.units for sp in u.params]
                opt.zero_grad()
            out[(stage, frozen)] = comm
    # model-state bytes at stage 3, fp32 AdamW, sizes divisible by 4: 16 psi / N
    for offload in (False, True):
        model = make_tiny(dim=16, hidden=32, vocab=64)
        _freeze(model) if offload else None
        sm = shard_model(model, backend, ShardingOptions(stage=3, offload_params=offload))
        opt = torch.optim.AdamW([p for p in sm.parameters() if p.requires_grad], lr=1e-2)
        sm.register_optimizer(opt)
        ids, labels = batch(0, 8, vocab=64)
        sm(ids[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]).backward()
        opt.step()
        out[("state", offload)] = sm.stats()["state_bytes"]
    backend.destroy_process_group()
    return out


def test_comm_and_state_bytes_match_zero_formulas() -> None:
    """World size 4 (world size 2 is checked on the parity job's byte counts, test_sharding_parity.py)."""
    world = 4
    results = run_workers(_account, world)
    model = make_tiny()
    frozen_model = make_tiny()
    _freeze(frozen_model)
    psi = psi_bytes(model, world)
    psi_root = psi_bytes(model, world, names=ROOT)
    for res in results:
        for frozen, m in ((False, model), (True, frozen_model)):
            flags = flag_bytes(m, world, "reduce_scatter")
            psi_train = psi_bytes(m, world, trainable_only=True) + flags
            s0, s1, s2, s3 = (res[(stage, frozen)] for stage in range(4))
            assert all(c == {"all_reduce": 2 * psi_bytes(m, world, trainable_only=True, padded=False)
                             + flag_bytes(m, world, "all_reduce")} for c in s0)
            for s in (s1, s2):
                assert s[0] == s[1] == {"all_gather": psi, "reduce_scatter": psi_train}
                assert s[2] == {"reduce_scatter": psi_train}  # its micro-step under no_sync did the gather
            assert all(c == {"all_gather": 2 * psi - psi_root, "reduce_scatter": psi_train} for c in s3)
            if not frozen:
                assert s2[1]["all_gather"] + s2[1]["reduce_scatter"] == 2 * psi + flags
                assert s3[1]["all_gather"] + s3[1]["reduce_scatter"] == 3 * psi - psi_root + flags
            else:
                assert psi_train - flags < psi  # frozen parameters are excluded from the reduce-scatter
            # no_sync: nothing is reduced; stage 3 still gathers (parameters are sharded), stages 1-2
            # gather the previous step's update once, stage 0 sends nothing
            assert res[(3, frozen, "no_sync")] == {"all_gather": 2 * psi - psi_root}
            assert res[(1, frozen, "no_sync")] == res[(2, frozen, "no_sync")] == {"all_gather": psi}
            assert res[(0, frozen, "no_sync")] == {}
            if frozen:
                for stage in range(4):
                    assert all(res[(stage, True, "frozen_grads")]) and res[(stage, True, "frozen_grads")]
                    assert not any(res[(stage, True, "frozen_state")])
                for stage in (1, 2, 3):
                    assert all(res[(stage, True, "full_grads")])  # full gradients freed after the reduce

    # model-state bytes per rank at stage 3 (same job)
    for res in results:
        state = res[("state", False)]
        psi = sum(p.numel() for p in make_tiny(dim=16, hidden=32, vocab=64).parameters())
        expected = 16 * psi / world  # fp32 params + fp32 grads + two fp32 Adam moments, sharded N ways
        assert abs(state["total"] - expected) <= 0.05 * expected, (state, expected)
        assert state["unsharded_params"] == 0  # every full parameter freed after backward
        assert state["offloaded"] == 0 and state["device"] == state["total"]
        # offload: the parameter shards (frozen ones included), gradients and optimizer state leave the device
        off = res[("state", True)]
        assert off["device"] == 0 and off["offloaded"] == off["total"]
        assert off["params"] == state["params"]  # frozen shards are offloaded too, not kept on device
