"""The default checkpoint resumes anywhere: 2 ranks -> 1, 1 -> 2, stage 3 -> stage 0, optimizer state
included, equal to the uninterrupted run; optimizer state that cannot be resharded (per-rank
statistics of a shard) resumes exactly on the same world size and is refused clearly elsewhere.
(real gloo processes; a fresh process group for every load)
"""

from __future__ import annotations

import os

import pytest
import torch
from support.distributed import run_workers
from test_checkpoint import SEEDABLE, K, _plain, _reference, _steps

pytestmark = pytest.mark.multiprocess


def _default_job(world_size, stage, optimizer="adamw"):
    """test_checkpoint's job with the config's default state_dict_type (no state_dict_type given)."""
    from test_checkpoint import GLOBAL_BATCH, Net, _data
    from torch.utils.data import DataLoader

    import xshard

    # the schedule counts optimizer steps whatever the world size (as in test_checkpoint._job)
    acc = xshard.Accelerator(config={"stage": stage}, seed=0, step_scheduler_with_optimizer=False,
                             dataloader_config=SEEDABLE)
    model = Net()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = RowScaledSGD(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // world_size, shuffle=True)
    return (acc, *acc.prepare(model, opt, loader, sched))


def _run(rank, world_size, load_from, save_to, stage):
    acc, model, opt, loader, sched = _default_job(world_size, stage)
    if load_from:
        acc.load_state(load_from)
    losses, _ = _steps(acc, model, opt, loader, sched, K)
    acc.save_state(save_to)
    return losses, _plain(model), acc.step


def test_the_default_checkpoint_resumes_on_any_world_size_and_stage(tmp_path):
    from safetensors.torch import load_file

    ref_losses, ref_state = _reference(3 * K)
    a, b, c, d = (str(tmp_path / name) for name in "abcd")
    losses_a, state_a, _ = run_workers(_run, 2, None, a, 3)[0]
    losses_b, _, step_b = run_workers(_run, 1, a, b, 3)[0]  # 2 ranks -> 1
    losses_c, state_c, step_c = run_workers(_run, 2, b, c, 0)[0]  # 1 rank -> 2, stage 3 -> stage 0
    losses_d, _, _ = run_workers(_run, 2, a, d, 0)[0]  # 2 ranks stage 3 -> 2 ranks stage 0
    assert losses_a + losses_b + losses_c == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert losses_d == pytest.approx(ref_losses[K:2 * K], rel=1e-5, abs=1e-6)
    assert (step_b, step_c) == (2 * K, 3 * K)
    for key, value in ref_state.items():
        torch.testing.assert_close(state_c[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    # the default keeps one plain state dict that any tool loads, equal to the model's full weights
    assert "model.safetensors" in os.listdir(a) and not any(n.endswith(".pt") and "optimizer.rank" in n
                                                             for n in os.listdir(a))
    plain = load_file(os.path.join(a, "model.safetensors"))
    assert plain.keys() == state_a.keys() and all(torch.equal(plain[k], v) for k, v in state_a.items())


# ---------------------------------------------------------------------- state not shaped like the shard


class RowScaledSGD(torch.optim.Optimizer):
    """SGD whose matrices' steps are scaled by running per-row gradient statistics (like Adafactor's
    factored second moment): the state ``row_sq`` has one value per row *this rank holds*."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() < 2:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                state = self.state[p]
                if "row_sq" not in state:
                    state["row_sq"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                state["row_sq"].mul_(0.9).add_(p.grad.pow(2).sum(dim=1), alpha=0.1)
                p.add_(p.grad / (state["row_sq"].sqrt() + 1e-3).unsqueeze(1), alpha=-group["lr"])


def _per_rank_save(rank, world_size, folder):
    acc, model, opt, loader, sched = _default_job(world_size, 3, optimizer="row")
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(os.path.join(folder, "full"))
    acc.save_state(os.path.join(folder, "sharded"), state_dict_type="sharded")
    losses, _ = _steps(acc, model, opt, loader, sched, 2)
    return losses, _plain(model)


def _per_rank_resume(rank, world_size, folder):
    out = {}
    for kind in ("full", "sharded"):
        acc, model, opt, loader, sched = _default_job(world_size, 3, optimizer="row")
        try:
            acc.load_state(os.path.join(folder, kind))
        except Exception as exc:
            out[kind] = f"{type(exc).__name__}: {exc}"
            continue
        losses, _ = _steps(acc, model, opt, loader, sched, 2)
        out[kind] = (losses, _plain(model))
    return out


def test_per_rank_optimizer_state_resumes_exactly_and_is_refused_on_another_world_size(tmp_path):
    losses, state = run_workers(_per_rank_save, 2, str(tmp_path))[0]
    same = run_workers(_per_rank_resume, 2, str(tmp_path))[0]
    for kind in ("full", "sharded"):
        resumed_losses, resumed_state = same[kind]
        assert resumed_losses == losses, kind  # bit for bit: each rank's row statistics came back
        assert all(torch.equal(resumed_state[k], v) for k, v in state.items()), kind
    other = run_workers(_per_rank_resume, 1, str(tmp_path))[0]
    for kind in ("full", "sharded"):
        assert other[kind].startswith("CheckpointMismatchError"), other[kind]
        assert "row_sq@rank0" in other[kind] and "cannot be resharded" in other[kind]
        assert "resume with the world size and stage that saved it" in other[kind]
