"""A run moves over from Accelerate + FSDP: ``load_state`` reads the folders Accelerate's ``save_state``
writes for an FSDP model (FULL_STATE_DICT: ``pytorch_model_fsdp.bin`` + ``optimizer.bin``;
SHARDED_STATE_DICT: the ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` torch.distributed.checkpoint
folders; ``scheduler.bin``; ``random_states_{rank}.pkl``) and for a DDP model (``model.safetensors`` and
a plain ``optimizer.state_dict()``), on another world size and stage, and the
run continues as plain PyTorch would. The folders are written here as Accelerate writes them, by
PyTorch's own FSDP2 and DCP on 2 gloo processes (accelerate itself is not needed)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from support.distributed import run_workers
from test_checkpoint import GLOBAL_BATCH, K, N, Net, _data, _job, _plain, _steps

from xshard.runtime.data import ShardSampler

pytestmark = pytest.mark.multiprocess


def _epoch0_batches(n_steps: int) -> list[list[int]]:
    order = list(ShardSampler(N, 1, 0, shuffle=True, seed=0))
    return [order[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH] for s in range(n_steps)]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _fsdp_worker(rank, world_size, root):
    """Train K steps with FSDP2, then save both kinds of Accelerate folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = _optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    data, per_rank = _data(), GLOBAL_BATCH // world_size
    for batch in _epoch0_batches(K):
        x, y = data[batch[rank * per_rank:(rank + 1) * per_rank]]
        model(x, y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    full, sharded = os.path.join(root, "full"), os.path.join(root, "sharded")
    everything = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_model_state_dict(model, options=everything), get_optimizer_state_dict(
        model, opt, options=everything)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(sharded, "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(sharded, "optimizer_0"))
    torch.manual_seed(1234 + rank)  # RNG states that the resumed ranks must get back
    rng = {"step": K, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
           "torch_manual_seed": torch.get_rng_state(), "torch_cuda_manual_seed": []}
    for folder in (full, sharded):
        os.makedirs(folder, exist_ok=True)
        if rank == 0:
            torch.save(weights, os.path.join(folder, "pytorch_model_fsdp.bin"))
            torch.save(optim, os.path.join(folder, "optimizer.bin"))
            torch.save(sched.state_dict(), os.path.join(folder, "scheduler.bin"))
        torch.save(rng, os.path.join(folder, f"random_states_{rank}.pkl"))
    if rank == 0:  # the sharded folder holds the DCP folders only
        os.remove(os.path.join(sharded, "pytorch_model_fsdp.bin"))
        os.remove(os.path.join(sharded, "optimizer.bin"))
    # A model that was not FSDP-wrapped (DDP): model.safetensors and a plain optimizer.state_dict(),
    # its state and param groups keyed by position.
    ddp = os.path.join(root, "ddp")
    os.makedirs(ddp, exist_ok=True)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(weights, os.path.join(ddp, "model.safetensors"))
        names = [name for group in optim["param_groups"] for name in group["params"]]
        position = {name: i for i, name in enumerate(names)}
        plain = {"state": {position[name]: value for name, value in optim["state"].items()},
                 "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in optim["param_groups"]]}
        torch.save(plain, os.path.join(ddp, "optimizer.bin"))
        torch.save(sched.state_dict(), os.path.join(ddp, "scheduler.bin"))
    torch.save(rng, os.path.join(ddp, f"random_states_{rank}.pkl"))
    dist.barrier()
    return torch.rand(3)  # what the RNG of this rank gives next


def _reference():
    """Plain PyTorch: K steps of epoch 0, then (a resumed job's fresh loader) epoch 0's first K batches again."""
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    data, losses = _data(), []
    for batch in _epoch0_batches(K) * 2:
        loss = model(*data[batch])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses[K:], model.state_dict()


def _xshard_worker(rank, world_size, root, stage):
    out = {}
    for kind in ("full", "sharded", "ddp"):
        acc, model, opt, loader, sched = _job(world_size, stage=stage)
        acc.load_state(os.path.join(root, kind))
        draws = torch.rand(3)
        losses, _ = _steps(acc, model, opt, loader, sched, K)
        out[kind] = (losses, _plain(model), draws, acc.step)
    acc, *_ = _job(world_size, stage=stage)
    local = os.path.join(root, "local")
    if rank == 0:
        os.makedirs(local)
        torch.save({}, os.path.join(local, "pytorch_model_fsdp_rank0.bin"))
        torch.save({}, os.path.join(local, "random_states_0.pkl"))
    acc.wait_for_everyone()
    try:
        acc.load_state(local)
        out["local"] = None
    except Exception as exc:
        out["local"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def accelerate_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    return root, run_workers(_fsdp_worker, 2, str(root))


@pytest.mark.parametrize("world_size, stage", [(1, 3), (2, 2)])
def test_accelerate_fsdp_folders_resume_on_any_world_size_and_stage(accelerate_folders, tmp_path, world_size, stage):
    import shutil

    root, draws = accelerate_folders
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    ref_losses, ref_state = _reference()
    results = run_workers(_xshard_worker, world_size, str(tmp_path), stage)
    for rank, out in enumerate(results):
        for kind in ("full", "sharded", "ddp"):
            losses, state, rng, step = out[kind]
            assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), kind  # weights and Adam moments
            for key, value in ref_state.items() if rank == 0 else ():  # full weights gather on rank 0
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            assert torch.equal(rng, draws[rank]), kind  # this rank's RNG state came back
            assert step == K  # steps since the resume (Accelerate saves no optimizer-step count)
        assert out["local"].startswith("CheckpointError") and "LOCAL_STATE_DICT" in out["local"]
        assert "FULL_STATE_DICT or SHARDED_STATE_DICT" in out["local"]
