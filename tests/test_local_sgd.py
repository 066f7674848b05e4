"""Accelerate's LocalSGD (examples/by_feature/local_sgd.py) on xshard: stage 0 gives stock Accelerate's weights on
2 gloo processes; at stages 1-3, where Accelerate refuses it as it refuses FSDP, the user is told to run at
stage 0 before LocalSGD's own error."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.distributed import run_workers

import xshard


def _train_with_local_sgd(rank: int, world_size: int, ours: bool) -> list[torch.Tensor]:
    from accelerate.local_sgd import LocalSGD

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    if ours:
        acc = xshard.Accelerator(stage=0, cpu=True)
    else:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2, enabled=True) as local_sgd:
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


@pytest.mark.multiprocess
def test_local_sgd_at_stage_0_gives_stock_accelerates_weights():
    ours, stock = run_workers(_train_with_local_sgd, 2, True), run_workers(_train_with_local_sgd, 2, False)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(ours[rank], stock[rank], strict=True)), rank


def test_local_sgd_at_stage_3_is_told_to_run_at_stage_0():
    from accelerate.local_sgd import LocalSGD

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = xshard.Accelerator(cpu=True, stage=3)
    told = [str(w.message) for w in caught if "LocalSGD" in str(w.message)]
    assert len(told) == 1 and "Run the script at stage 0" in told[0] and "stage 3" in told[0]
    model = acc.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="LocalSGD is supported only"):  # Accelerate's own refusal
        LocalSGD(accelerator=acc, model=model, local_sgd_steps=2)
    acc.end()
