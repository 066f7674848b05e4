"""DistributedDataParallelKwargs(comm_hook=...) at stage 0 gives stock Accelerate's numbers (2 gloo ranks).

Accelerate's example ``ddp_comm_hook.py`` compresses DDP's gradient buckets to fp16 or bf16 for the
all-reduce. The same snippet runs under stock Accelerate (DDP with torch's hook) and under xshard at stage 0
(its own bucketed all-reduce), and the losses and final weights must be equal, bit for bit: the compressed
hooks' rounding shows in the weights, so ignoring the hook would fail here. torch refuses its bf16 hook
outside CUDA/XPU by the function's name, so on gloo the stock side registers the same function under
another name.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

HOOKS = ("no", "fp16", "bf16")


def _snippet(accelerator, kwargs_cls, hook_type, after_prepare=None) -> dict[str, tuple[list[float], list[torch.Tensor]]]:
    """Train a tiny model a few steps under each hook; the losses and final weights of each."""
    out = {}
    for hook in HOOKS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        acc = accelerator(hook_type(hook), kwargs_cls)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        if after_prepare is not None:
            after_prepare(hook_type(hook), model)
        losses = []
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[hook] = (losses, [p.detach().clone() for p in acc.unwrap_model(model).parameters()])
    return out


def _stock(rank: int, world_size: int) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def build(hook, kwargs_cls):
        AcceleratorState._reset_state()  # one Accelerator per hook; the process group stays
        on_gloo = hook if hook != DDPCommunicationHookType.BF16 else DDPCommunicationHookType.NO
        return Accelerator(cpu=True, kwargs_handlers=[kwargs_cls(comm_hook=on_gloo)])

    def bf16_on_gloo(hook, model):
        if hook == DDPCommunicationHookType.BF16:
            model.register_comm_hook(None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket))

    return _snippet(build, DistributedDataParallelKwargs, DDPCommunicationHookType, bf16_on_gloo)


def _xshard(rank: int, world_size: int) -> dict:
    from xshard import Accelerator
    from xshard.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    def build(hook, kwargs_cls):
        return Accelerator(stage=0, cpu=True, kwargs_handlers=[kwargs_cls(comm_hook=hook)])

    return _snippet(build, DistributedDataParallelKwargs, DDPCommunicationHookType)


def test_comm_hooks_at_stage_0_give_stock_accelerates_losses_and_weights():
    stock, ours = run_workers(_stock, 2), run_workers(_xshard, 2)
    for rank in range(2):
        for hook in HOOKS:
            stock_losses, stock_weights = stock[rank][hook]
            losses, weights = ours[rank][hook]
            assert losses == stock_losses, (rank, hook)
            assert all(torch.equal(a, b) for a, b in zip(weights, stock_weights, strict=True)), (rank, hook)
    # the hooks change the numbers (so a hook that was not applied could not pass the comparison above)
    no_hook = stock[0]["no"][1]
    for hook in ("fp16", "bf16"):
        assert not all(torch.equal(a, b) for a, b in zip(stock[0][hook][1], no_hook, strict=True)), hook
