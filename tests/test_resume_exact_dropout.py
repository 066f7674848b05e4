"""A run with dropout, saved inside its loop over a plain ``shuffle=True`` loader and resumed, ends at the
uninterrupted run's weights, bit for bit.

Every ``iter(DataLoader)`` draws its workers' base seed from torch's global RNG (the loader has no generator
of its own). The uninterrupted loop draws once, when the epoch starts; the resumed loop makes its iterator
after ``load_state`` restored the RNG, and used to draw once more there, so every dropout mask after the
resume was shifted (and the workers' seeds changed). The loops below are written as users write them: the
loop keeps iterating the loader across ``save_state``; the resumed run calls ``load_state`` in a new
Accelerator and continues either as docs/data-loading.md shows (``while acc.step < TOTAL``, the loader's
restored position) or with ``skip_first_batches`` as Accelerate's docs show. Saves fall mid-epoch and on
the last batch of an epoch, with 0 and 2 workers, on 1 and 2 processes. The same job under
``xshard launch --max_restarts 1`` with a rank killed: tests/test_users_restart_naming.py (its script has
dropout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.distributed import run_workers
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

import xshard

#: 24 samples in batches of 4: 6 steps an epoch on one process, 3 on two
SAMPLES, BATCH, TOTAL_STEPS = 24, 4, 8


class Seeded(Dataset):
    """Samples that also carry the base seed of the worker that loaded them (-1 without workers): a user's
    augmentation in a worker draws from that seed, so a resumed epoch's workers must have the same."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 8, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        worker = get_worker_info()
        base_seed = -1 if worker is None else worker.seed - worker.id
        return self.x[i], self.x[i].sum().sin(), torch.tensor(base_seed)


def train(rank: int, world: int, out: str, save_at: int | None, resume: str, workers: int,
          persistent: bool = False) -> tuple[dict, dict]:
    """Train to ``TOTAL_STEPS``; save at step ``save_at`` without leaving the loader; with ``resume``
    ("position" or "skip") load that checkpoint first and continue. The final weights, and the workers'
    base seed of each step's batch. ``persistent``: the loader keeps its workers (``persistent_workers``)."""
    torch.set_num_threads(1)
    acc = xshard.Accelerator(seed=0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Seeded(), batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=persistent)
    model, opt, loader = acc.prepare(model, opt, loader)
    ckpt = Path(out) / "ckpt"
    seeds: dict[int, int] = {}

    def step(xb: torch.Tensor, yb: torch.Tensor, seed: torch.Tensor) -> None:
        seeds[acc.step + 1] = int(seed[0])
        acc.backward(nn.functional.mse_loss(model(xb).squeeze(-1), yb))
        opt.step()
        opt.zero_grad()
        if resume == "none" and acc.step == save_at:
            acc.save_state(ckpt)

    if resume != "none":
        acc.load_state(ckpt)
    if resume == "skip":  # Accelerate's docs: the epoch and the batches of it to skip, from the step
        first_epoch, skip = divmod(acc.step, len(loader))
        for epoch in range(first_epoch, TOTAL_STEPS // len(loader) + 1):
            batches = acc.skip_first_batches(loader, skip) if epoch == first_epoch else loader
            for xb, yb, seed in batches:
                step(xb, yb, seed)
                if acc.step == TOTAL_STEPS:
                    break
    else:  # docs/data-loading.md: the position comes from the restored state
        while acc.step < TOTAL_STEPS:
            for xb, yb, seed in loader:
                step(xb, yb, seed)
                if acc.step == TOTAL_STEPS:
                    break
    weights = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    acc.end()
    acc.free_memory()  # persistent workers end with their loader, not at the interpreter's exit
    return weights, seeds


def _assert_same(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    (got, got_seeds), (want, want_seeds) = got, want
    assert got_seeds == {k: v for k, v in want_seeds.items() if k in got_seeds}, "the workers' seeds differ"
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"resumed weights differ from the uninterrupted run's in {different}"


# save_at: mid-epoch (step 3 of 6), and the last batch of the first epoch (step 6 of 6)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save_at", [3, 6])
@pytest.mark.parametrize("resume", ["position", "skip"])
def test_one_process_resume_with_dropout_is_bit_exact(tmp_path, workers, save_at, resume, clean_env):
    straight = train(0, 1, str(tmp_path), save_at, "none", workers)
    resumed = train(0, 1, str(tmp_path), save_at, resume, workers)
    _assert_same(resumed, straight)


@pytest.mark.parametrize("save_at", [3, 6])
def test_one_process_resume_with_persistent_workers_is_bit_exact(tmp_path, save_at, clean_env):
    """Persistent workers draw their base seed once per run: the resumed run's workers get that seed."""
    straight = train(0, 1, str(tmp_path), save_at, "none", 2, True)
    _assert_same(train(0, 1, str(tmp_path), save_at, "position", 2, True), straight)


def _on_two(tmp_path: Path, save_at: int, workers: int) -> None:
    straight = run_workers(train, 2, str(tmp_path), save_at, "none", workers)
    resumed = run_workers(train, 2, str(tmp_path), save_at, "position", workers)
    _assert_same(resumed[0], straight[0])


# save_at on two processes: mid-epoch (step 2 of 3), and the last batch of the first epoch (step 3)
@pytest.mark.multiprocess
@pytest.mark.parametrize(("save_at", "workers"), [(2, 0), (3, 0), (2, 2)])
def test_two_processes_resume_with_dropout_is_bit_exact(tmp_path, save_at, workers, clean_env):
    _on_two(tmp_path, save_at, workers)

