"""Async save on a device whose copies to host memory land late (CUDA, NPU): the files hold the values at save time.

On those devices the async save's copies into pinned host buffers only queue on the device's stream
(``non_blocking=True``); the background writer may read the buffers only after the device has run them,
which ``save_state`` makes sure of with the backend's ``synchronize()`` before it starts the writer. The
CPU backend cannot show that (its copies are done when ``copy_`` returns), so the job here runs on the
NPU backend, emulated: the fake torch_npu (support/fakes/npu.py) with ``LateHostCopies``
(support/fakes/host_copies.py), whose pinned buffers receive a queued copy only at ``torch.npu.synchronize()``.
One process: the NPU backend's own process group ("hccl", over gloo in the fake) of one rank.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from support.fakes.host_copies import LateHostCopies
from support.models import RegressionNet, regression_data
from torch.utils.data import DataLoader

import xshard
from xshard.backends import backend_class

pytest_plugins = ("support.fakes.fixtures",)  # fixtures: fake_npu


def _step(acc, model, opt, batch) -> None:
    x, y = batch
    acc.backward(model(x, y))
    opt.step()
    opt.zero_grad()


def test_an_async_save_writes_what_the_device_copied_not_what_the_host_buffers_held(fake_npu, clean_env, tmp_path):
    # the fake device has no kernels: its tensors stay on the CPU (as in the emulated NPU fine-tune)
    clean_env.setattr(backend_class("npu"), "device", lambda self, local_rank=None: torch.device("cpu"))
    folder = tmp_path / "checkpoint"
    with LateHostCopies(torch.npu) as device:
        acc = xshard.Accelerator(backend="npu", config={"stage": 3, "state_dict_type": "full"}, seed=0)
        net = RegressionNet()
        model, opt, loader = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                         DataLoader(regression_data(), batch_size=8))
        batches = iter(loader)
        for _ in range(2):
            _step(acc, model, opt, next(batches))
        at_save = {k: v.clone() for k, v in model.full_state_dict().items()}
        rng_at_save = torch.get_rng_state()
        acc.save_state(folder, async_save=True)
        _step(acc, model, opt, next(batches))  # training goes on while the files are written
        acc.end()  # waits for the background write
    assert device.made > 0  # the save's copies to host memory were asynchronous
    assert any(not torch.equal(v, model.full_state_dict()[k]) for k, v in at_save.items())
    written = load_file(folder / "model.safetensors")  # the copies into the file image
    assert sorted(written) == sorted(at_save)
    assert [k for k, v in at_save.items() if not torch.equal(written[k], v)] == []
    rng = torch.load(folder / "rng.rank0.pt", weights_only=True)  # the copies of torch.save's tensors
    assert torch.equal(rng["torch"], rng_at_save)
