"""Checkpoints on real torch_xla (one replica on XLA:CPU): save moves tensors to the host, load
copies them back onto the device, and training resumes exactly.

Run in the XLA environment: ``PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/test_checkpoint_xla.py``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from support.models import batch, make_tiny  # noqa: E402

pytestmark = pytest.mark.xla


def _job():
    import xshard

    acc = xshard.Accelerator(config={"stage": 3, "auto_wrap_policy": "none"}, backend="xla", seed=0)
    model = make_tiny().to(acc.device)
    model.head.weight = model.embed.weight  # Module.to() onto XLA makes new Parameters: tie again
    model = acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return acc, model, opt


def _train(acc, model, opt, first_step, steps):
    losses = []
    for step in range(first_step, first_step + steps):
        ids, labels = batch(step, 4)
        loss = model(ids.to(acc.device), labels.to(acc.device))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_xla_checkpoint_resumes_exactly(tmp_path, kind, clean_env) -> None:
    clean_env.setenv("PJRT_DEVICE", "CPU")
    acc, model, opt = _job()
    _train(acc, model, opt, 0, 2)
    acc.save_state(tmp_path / "ckpt", state_dict_type=kind)
    expected = _train(acc, model, opt, 2, 2)
    acc2, model2, opt2 = _job()
    acc2.load_state(tmp_path / "ckpt")
    assert _train(acc2, model2, opt2, 2, 2) == pytest.approx(expected, rel=1e-6)
    for job in (acc, acc2):  # a job left open keeps xm.optimizer_step patched until its model is collected
        job.end()
