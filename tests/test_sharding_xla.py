"""The sharded core on real torch_xla, one replica on XLA:CPU (no resizable storage: tensors are replaced).

Run in the XLA environment: ``PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/test_sharding_xla.py``.
"""

from __future__ import annotations

import gc
import os
import warnings

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from support.models import batch, make_tiny  # noqa: E402

from xshard.sharding import ShardingOptions, shard_model  # noqa: E402

pytestmark = pytest.mark.xla


@pytest.fixture
def backend(monkeypatch):
    from xshard.backends import get_backend

    monkeypatch.setenv("XSHARD_BACKEND", "xla")
    b = get_backend()
    b.init_process_group()
    yield b
    gc.collect()  # a test that failed before close(): its model's finalizer undoes the step patch


def _train(model, opt, backend, steps: int, device) -> list[float]:
    losses = []
    for step in range(steps):
        ids, labels = batch(step, 4)
        loss = model(ids.to(device), labels.to(device))
        loss.backward()
        norm = model.clip_grad_norm_(0.05) if hasattr(model, "clip_grad_norm_") else \
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        backend.optimizer_step(opt)
        opt.zero_grad()
        losses.append((loss.item(), norm.item()))
    return losses


@pytest.mark.parametrize("stage,checkpointing", [(3, True), (2, False), (0, False)])
def test_xla_training_matches_cpu(backend, stage: int, checkpointing: bool) -> None:
    assert backend.frees_storage_by_resize is False
    device = backend.device()
    ref = make_tiny()
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), backend, 3, "cpu")

    model = make_tiny().to(device)  # on the device first: the Parameter objects survive sharding
    model.head.weight = model.embed.weight  # Module.to() onto XLA makes new Parameters: tie again
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)  # built before shard_model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sm = shard_model(model, backend, ShardingOptions(stage=stage, activation_checkpointing=checkpointing))
    assert all(a is b for a, b in zip(sm.parameters(), params, strict=True))
    losses = _train(sm, opt, backend, 3, device)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
    full = sm.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0)
    if stage == 3:  # freed by replacing the tensor (XLA has no storage to resize)
        assert all(sp.full.numel() == 0 for u in sm.units for sp in u.params)
    sm.close()


def test_cpu_model_on_xla_gets_new_parameters_that_an_optimizer_is_rebound_to(backend) -> None:
    from xshard.runtime.rebind import rebind_optimizer

    model = make_tiny()
    old = list(dict.fromkeys(model.parameters()))
    optimizer = torch.optim.SGD(old, lr=0.1)  # built before sharding, on the CPU Parameters
    sm = shard_model(model, backend, ShardingOptions(stage=3))
    new = list(dict.fromkeys(sm.parameters()))
    assert all(p.device.type == "xla" for p in new)
    assert all(sm.rebound_parameters.new[id(o)] is n for o, n in zip(old, new, strict=True))
    assert rebind_optimizer(optimizer, sm.rebound_parameters.new) == len(old)
    assert optimizer.param_groups[0]["params"] == new
    sm.close()
