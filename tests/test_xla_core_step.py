"""The training step around the sharded core on real torch_xla (one XLA:CPU device).

- Accelerator on XLA: batches through torch_xla's MpDeviceLoader, bf16 through
  ``torch.autocast("xla")``, one graph per step (the compile count stays flat after warm-up),
  ``xm.optimizer_step`` patched while a sharded model lives and restored by ``acc.end()``;
  stage 0 keeps the real ``xm.optimizer_step``.
- The patched step is announced once in the log.
- activation_checkpointing (xla_fsdp_grad_ckpt) needs an auto-wrap policy.
"""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from support.models import batch  # noqa: E402
from support.xla_core_runs import GLOBAL_BATCH, build_tiny, train_on_cpu_backend  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import xshard  # noqa: E402
from xshard.backends.devices.xla import OptimizerStepPatch  # noqa: E402
from xshard.sharding import ShardingOptions, shard_model  # noqa: E402

pytestmark = pytest.mark.xla
xr.world_size()  # start the PJRT runtime before this process's first backward (see XLABackend.__init__)

STEPS = 5


@pytest.fixture
def xla_env(clean_env):
    clean_env.setenv("PJRT_DEVICE", "CPU")
    return clean_env


@pytest.fixture
def loaders_made(monkeypatch):
    """Count the MpDeviceLoaders that the XLA backend builds."""
    import torch_xla.distributed.parallel_loader as pl

    made = []

    class CountingMpDeviceLoader(pl.MpDeviceLoader):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pl, "MpDeviceLoader", CountingMpDeviceLoader)
    return made


def _loader() -> DataLoader:
    ids, labels = zip(*(batch(step, GLOBAL_BATCH) for step in range(STEPS)), strict=True)
    return DataLoader(TensorDataset(torch.cat(ids), torch.cat(labels)), batch_size=GLOBAL_BATCH)


def test_accelerator_step_on_xla_is_one_graph_with_bf16_and_the_patch_scoped(xla_env, loaders_made) -> None:
    original_step = xm.optimizer_step
    acc = xshard.Accelerator(backend="xla", stage=3, mixed_precision="bf16", activation_checkpointing=True, seed=0)
    model = build_tiny(acc.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, _loader())
    assert xm.optimizer_step is not original_step  # a sharded model is alive: the step is patched
    losses, compiles, dtypes = [], [], set()
    for ids, labels in loader:
        assert ids.device.type == "xla"
        with acc.accumulate(model), acc.autocast():
            logits = model(ids)
            dtypes.add(logits.dtype)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        compiles.append(met.metric_data("CompileTime")[0])
    assert len(loaders_made) == 1  # batches came through torch_xla's MpDeviceLoader
    assert dtypes == {torch.float32}  # computed in bf16, returned in fp32 (as Accelerate does)
    assert {sp.full.dtype for u in model.units for sp in u.params if sp.full.is_floating_point()} == {torch.bfloat16}
    # step 1 traces Adam without state, step 2 with: from then on no step compiles anything
    assert compiles[1] == compiles[-1], compiles
    reference = train_on_cpu_backend(3, STEPS, checkpointing=True)["losses"]  # fp32
    torch.testing.assert_close(torch.stack(losses).cpu(), torch.tensor(reference), rtol=2e-2, atol=0)
    acc.end()
    assert xm.optimizer_step is original_step


def test_stage0_keeps_the_real_xm_optimizer_step(xla_env) -> None:
    original_step = xm.optimizer_step
    acc = xshard.Accelerator(backend="xla", stage=0, seed=0)
    acc.prepare(build_tiny(acc.device))
    assert xm.optimizer_step is original_step
    acc.end()


def test_patched_step_steps_once_per_call_and_is_announced_once(xla_env, monkeypatch, caplog) -> None:
    from xshard.backends import get_backend

    backend = get_backend("xla")
    device = backend.device()
    model = shard_model(build_tiny(device), backend, ShardingOptions(stage=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(OptimizerStepPatch, "_announced", False)
    with caplog.at_level(logging.INFO, logger="xshard.backends"):
        for step in range(2):
            ids, labels = batch(step, GLOBAL_BATCH)
            model(ids.to(device), labels.to(device)).backward()
            before = [p.detach().cpu().clone() for p in model.parameters()]
            xm.optimizer_step(optimizer)
            after = [p.detach().cpu() for p in model.parameters()]
            for b, a, p in zip(before, after, model.parameters(), strict=True):
                torch.testing.assert_close(a, b - 0.1 * p.grad.cpu())  # exactly one plain SGD step
            optimizer.zero_grad()
    announced = [r for r in caplog.records if "without its gradient all-reduce" in r.getMessage()]
    assert len(announced) == 1
    model.close()


@pytest.mark.parametrize("via", ["options", "accelerator"])
def test_activation_checkpointing_needs_an_auto_wrap_policy(xla_env, via: str) -> None:
    message = "activation_checkpointing.*auto_wrap_policy='none'.*transformer_layer_cls_to_wrap"
    if via == "options":
        from xshard.backends import get_backend

        backend = get_backend("xla")
        with pytest.raises(ValueError, match=message):
            shard_model(build_tiny(backend.device()), backend,
                        ShardingOptions(stage=3, activation_checkpointing=True, auto_wrap_policy="none"))
    else:  # the HF Trainer's fsdp_config key
        acc = xshard.Accelerator(backend="xla", xla_fsdp_grad_ckpt=True, auto_wrap_policy="none", seed=0)
        with pytest.raises(ValueError, match=message):
            acc.prepare(build_tiny(acc.device))
        acc.end()
