"""Checkpoints: exact resume for every state_dict_type, resharding 4 -> 2 -> 1 and 2 -> 4, crash safety,
bad files, and consolidation of a sharded checkpoint (real gloo processes; a fresh process group for
every load).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.distributed import run_workers
from support.models import RegressionNet, regression_data
from torch.utils.data import DataLoader, TensorDataset

from xshard.runtime.data import ShardSampler
from xshard.utils import DataLoaderConfiguration

#: a plain shuffle's order from the seed and the epoch (Accelerate's seedable sampler), the same on every
#: world size: the order of the references here
SEEDABLE = DataLoaderConfiguration(use_seedable_sampler=True)

pytestmark = pytest.mark.multiprocess

N, DIM, K = 32, 8, 5  # samples, features, steps before / after the save
GLOBAL_BATCH = 4


class Net(RegressionNet):
    """The checkpoint tests' model: two residual blocks on ``DIM`` features."""

    def __init__(self, dropout: float = 0.0, width: int = 16) -> None:
        super().__init__(DIM, width, depth=2, dropout=dropout)


def _data() -> TensorDataset:
    return regression_data(N, DIM)


def _job(world_size, stage=3, dropout=0.0, width=16, state_dict_type="full"):
    import xshard

    # the schedule counts optimizer steps whatever the world size (the tests reshard 4 -> 2 -> 1), not
    # Accelerate's default of one step per process per optimizer step
    acc = xshard.Accelerator(config={"stage": stage, "state_dict_type": state_dict_type}, seed=0,
                             step_scheduler_with_optimizer=False, dataloader_config=SEEDABLE)
    model = Net(dropout, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // world_size, shuffle=True)
    return (acc, *acc.prepare(model, opt, loader, sched))


#: each loader's batches over its epochs, continued by the next ``_steps`` call (one training loop that saves
#: inside it and goes on): id -> (the loader, kept alive so its id is not reused, and the batches)
_LOOPS: dict[int, tuple[Any, Iterator[Any]]] = {}


def _epochs(loader) -> Iterator[Any]:
    while True:
        yield from loader


def _steps(acc, model, opt, loader, sched, n):
    """``n`` more optimizer steps of the loader's loop, across epoch ends (where the last call on this loader
    stopped); returns (losses, first feature of every batch seen)."""
    losses, seen = [], []
    batches = _LOOPS.setdefault(id(loader), (loader, _epochs(loader)))[1]
    for x, y in itertools.islice(batches, n):
        loss = model(x, y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
        seen.append(acc.gather(x[:, 0].contiguous()))
    return losses, seen


def _plain(model):
    return {k: v.clone() for k, v in model.full_state_dict().items()}


# ---------------------------------------------------------------------- exact resume


def _save_worker(rank, world_size, folder):
    acc, model, opt, loader, sched = _job(world_size, dropout=0.2)
    straight = _steps(acc, model, opt, loader, sched, 2 * K)
    straight_state = _plain(model)
    acc, model, opt, loader, sched = _job(world_size, dropout=0.2)
    _steps(acc, model, opt, loader, sched, K)
    for kind in ("full", "local", "sharded"):
        acc.save_state(os.path.join(folder, kind), state_dict_type=kind)
    return straight, straight_state


def _resume_worker(rank, world_size, folder):
    out = {}
    for kind in ("full", "local", "sharded"):
        acc, model, opt, loader, sched = _job(world_size, dropout=0.2)
        acc.load_state(os.path.join(folder, kind))
        losses, seen = _steps(acc, model, opt, loader, sched, K)
        out[kind] = (losses, seen, _plain(model), acc.step)
    return out


def test_resume_is_bit_exact_for_every_state_dict_type(tmp_path):
    straight, straight_state = run_workers(_save_worker, 2, str(tmp_path))[0]
    resumed = run_workers(_resume_worker, 2, str(tmp_path))[0]  # fresh processes, fresh process group
    for kind, (losses, seen, state, step) in resumed.items():
        assert losses == straight[0][K:], kind  # bit for bit (dropout included: RNG states restored)
        assert all(torch.equal(a, b) for a, b in zip(seen, straight[1][K:], strict=True)), kind  # data order
        for key, value in straight_state.items():
            assert torch.equal(state[key], value), (kind, key)
        assert step == 2 * K
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert files == ["data.pt", "model.rank0.safetensors", "model.rank1.safetensors", "optimizer.groups.pt",
                     "optimizer.rank0.safetensors", "optimizer.rank1.safetensors", "rng.rank0.pt", "rng.rank1.pt",
                     "scheduler.pt", "xshard_state.json"]


# ---------------------------------------------------------------------- resharding


def _reference(steps: int):
    """Plain PyTorch in one process on the global batch: losses and final weights."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    data, sampler, losses, epoch = _data(), ShardSampler(N, 1, 0, shuffle=True, seed=0), [], 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for s in range(N // GLOBAL_BATCH):
            loss = model(*data[order[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return losses, model.state_dict()


def _reshard_worker(rank, world_size, load_from, save_to, stage):
    acc, model, opt, loader, sched = _job(world_size, stage=stage)
    if load_from:
        acc.load_state(load_from)
    losses, _ = _steps(acc, model, opt, loader, sched, K)
    acc.save_state(save_to, state_dict_type="sharded")
    return losses, _plain(model)


def test_sharded_checkpoint_reshards_4_2_1_and_2_4_and_consolidates(tmp_path):
    from xshard.cli import main

    ref_losses, ref_state = _reference(3 * K)
    a, b, c, d = (str(tmp_path / name) for name in "abcd")
    losses4, state4 = run_workers(_reshard_worker, 4, None, a, 3)[0]
    losses2, _ = run_workers(_reshard_worker, 2, a, b, 2)[0]  # 4 ranks -> 2 (and stage 3 -> 2)
    losses1, _ = run_workers(_reshard_worker, 1, b, c, 3)[0]  # 2 -> 1
    losses4b, final = run_workers(_reshard_worker, 4, b, d, 3)[0]  # 2 -> 4
    assert losses4 + losses2 + losses1 == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert losses4b == pytest.approx(ref_losses[2 * K:], rel=1e-5, abs=1e-6)
    assert final.keys() == ref_state.keys()

    # consolidate: the sharded checkpoint written on 4 ranks -> one state dict equal to full_state_dict
    assert main(["consolidate", a, str(tmp_path / "a.safetensors")]) == 0
    from safetensors.torch import load_file

    merged = load_file(str(tmp_path / "a.safetensors"))
    assert merged.keys() == state4.keys()
    assert all(torch.equal(merged[k], v) for k, v in state4.items())
    # after 4 -> 2 -> 4 ranks and stages 3 -> 2 -> 3, the weights are still the reference's
    merged_d = load_file(str(_consolidated(d, tmp_path / "d.safetensors")))
    assert merged_d.keys() == ref_state.keys()
    for key, value in ref_state.items():
        torch.testing.assert_close(merged_d[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def _late_checker_worker(rank, world_size, root):
    import time
    from pathlib import Path

    from xshard.checkpoint import save_load as checkpoint_state

    acc, model, opt, loader, sched = _job(world_size, stage=3, state_dict_type="sharded")
    _steps(acc, model, opt, loader, sched, 1)
    check = checkpoint_state.check_destination
    seen = []

    def late_check(final):
        if rank == 1:
            time.sleep(1.0)  # a rank that reaches the save late (a slow filesystem, a busy host)
        seen.extend(sorted(p.name for p in Path(root).iterdir() if p.name != ".xshard_job.lock"))  # the job's lock
        check(final)

    checkpoint_state.check_destination = late_check
    acc.save_state(Path(root) / "checkpoint-1")
    return seen


def test_no_rank_changes_the_folder_before_every_rank_checked_it(tmp_path):
    """Rank 0 creates the save's work folder only after every rank decided the destination is safe: a
    rank that checked while rank 0 was creating it saw it half made and refused the save alone."""
    assert run_workers(_late_checker_worker, 2, str(tmp_path)) == [[], []]
    assert (tmp_path / "checkpoint-1" / "xshard_state.json").is_file()


def _consolidated(checkpoint, out):
    from xshard.checkpoint.consolidate import consolidate

    return consolidate(checkpoint, out)
