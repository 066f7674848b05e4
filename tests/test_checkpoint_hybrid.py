"""Checkpoints of a hybrid-sharded job (4 ranks as 2 nodes of 2): each row is written once (by the first
replica), a sharded checkpoint loads on 4 ranks sharded plainly and on 1 rank and training goes on as
plain PyTorch's, the default (full) checkpoint's optimizer rows too, and a local checkpoint resumes only
with the same shard groups.
"""

from __future__ import annotations

import json
import os

import pytest
from support.distributed import run_workers
from test_checkpoint import GLOBAL_BATCH, SEEDABLE, K, Net, _data, _reference, _steps
from torch.utils.data import DataLoader

pytestmark = pytest.mark.multiprocess


def _job(world_size, config):
    import torch

    import xshard

    acc = xshard.Accelerator(config=config, seed=0, step_scheduler_with_optimizer=False, dataloader_config=SEEDABLE)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // world_size, shuffle=True)
    return (acc, *acc.prepare(model, opt, loader, sched))


def _worker(rank, world_size, config, load_from, save_to, refused=None):
    """K steps after loading ``load_from``; saves a sharded (and a local, and a full) checkpoint to ``save_to``.
    ``refused``: a checkpoint this job must refuse (its error message is returned)."""
    from xshard.checkpoint import CheckpointError

    acc, model, opt, loader, sched = _job(world_size, config)
    error = None
    if refused:
        try:
            acc.load_state(refused)
        except CheckpointError as exc:
            error = str(exc)
    if load_from:
        acc.load_state(load_from)
    losses, _ = _steps(acc, model, opt, loader, sched, K)
    if save_to:
        acc.save_state(save_to, state_dict_type="sharded")
        acc.save_state(save_to + "-local", state_dict_type="local")
        acc.save_state(save_to + "-full")  # the default: one model file, the optimizer by rows
    return losses, error


def test_hybrid_checkpoint_writes_rows_once_and_loads_on_4_and_1(tmp_path):
    ref_losses, _ = _reference(3 * K)
    hybrid = {"stage": 3, "shard_group_size": 2}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first, _ = run_workers(_worker, 4, hybrid, None, a)[0]
    # 2x2 -> 4 sharded plainly (a local checkpoint, whose optimizer state is per rank, is refused first)
    results = run_workers(_worker, 4, {"stage": 3}, a, b, a + "-local")
    second = results[0][0]
    assert all(e is not None and "'shard_group_size' is 2 in the checkpoint but None" in e for _, e in results)
    third, _ = run_workers(_worker, 1, {"stage": 2}, b, None)[0]  # -> 1 rank (and stage 2)
    assert first + second + third == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    # the local checkpoint resumes with the same shard groups
    resumed, _ = run_workers(_worker, 4, hybrid, a + "-local", None)[0]
    assert resumed == pytest.approx(ref_losses[K:2 * K], rel=1e-5, abs=1e-6)
    # the default checkpoint resumes on one process
    from_full, _ = run_workers(_worker, 1, {"stage": 3}, a + "-full", None)[0]
    assert from_full == pytest.approx(ref_losses[K:2 * K], rel=1e-5, abs=1e-6)

    manifest = json.loads((tmp_path / "a" / "xshard_state.json").read_text())
    full = json.loads((tmp_path / "a-full" / "xshard_state.json").read_text())
    assert manifest["shard_group_size"] == full["shard_group_size"] == 2
    assert {f for entry in full["tables"]["model0"].values() for f, *_ in entry.get("pieces", [])} \
        == {"model.safetensors"}
    for table, entries in (("model0", manifest["tables"]["model0"]), ("optimizer0", manifest["tables"]["optimizer0"]),
                           ("full optimizer0", full["tables"]["optimizer0"])):
        for key, entry in entries.items():
            pieces = entry.get("pieces", [])
            rows = [(lo, hi) for _, lo, hi in pieces]
            assert rows == sorted(set(rows)), (table, key)  # each row range once: replica 1 wrote nothing
            assert {f.split(".")[-2] for f, *_ in pieces} <= {"rank0", "rank1"}, (table, key)
            if pieces:
                assert rows[0][0] == 0 and rows[-1][1] == (entry["shape"] or [1])[0], (table, key)
    assert os.path.exists(os.path.join(a, "model.rank3.safetensors"))  # written, holding no rows
