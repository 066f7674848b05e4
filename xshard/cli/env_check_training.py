"""The parts of `xshard env --check` that only the hardware can show, beyond single collectives.

- ``views_check``: collectives on device tensors that are views at storage offsets (slices of a larger
  buffer, as the sharded core's flat buffers are): the right values, and nothing written outside them.
- ``train_step_check``: one training step of a tiny model in bf16 or fp16 on the device (fp16 with the
  backend's own GradScaler: torch_npu's on an NPU), against the same step in fp32 on the CPU; in fp16
  also a step whose gradients overflow, which the scaler must skip while lowering its scale (on chips
  that flag overflow instead of producing inf, e.g. Ascend 910A, this is where it shows).
- ``stage3_check``: a ZeRO-3 step of a two-unit model through ``xshard.sharding``, every rank on its
  slice of the batch, against plain PyTorch on the whole batch on the CPU.

Each returns a one-line description of what it saw, or raises ``CheckFailed`` saying what differed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from xshard.backends import Backend, Collectives

LR = 0.1


class CheckFailed(Exception):
    """A check ran and saw something wrong (the message says what)."""


def expect(ok: bool, message: str) -> None:
    """Fail the check with ``message`` unless ``ok``."""
    if not ok:
        raise CheckFailed(message)


# ---------------------------------------------------------------- collectives on views


def views_check(backend: Backend, coll: Collectives, world_size: int, rank: int) -> str:
    """all_reduce, all_gather, reduce_scatter and broadcast on views at storage offsets."""
    dev, n = backend.device(), world_size

    def buffer(size: int) -> torch.Tensor:
        return torch.full((size,), -7.0, device=dev)

    def untouched(buf: torch.Tensor, start: int, stop: int, what: str) -> None:
        outside = torch.cat([buf[:start], buf[stop:]]).cpu()
        expect(bool((outside == -7.0).all()), f"{what} wrote outside its view: {buf.cpu().tolist()}")

    buf = buffer(11)
    view = buf[3:7]  # storage offset 3
    view.fill_(float(rank + 1))
    coll.all_reduce(view, op="sum")
    expect(torch.equal(view.cpu(), torch.full((4,), n * (n + 1) / 2)), f"all_reduce gave {view.cpu().tolist()}")
    untouched(buf, 3, 7, "all_reduce")

    src, out_buf = buffer(6), buffer(3 * n + 5)
    shard = src[1:4]  # offset 1
    shard.copy_(torch.arange(3.0, device=dev) + 10 * rank)
    out = out_buf[2:2 + 3 * n]  # offset 2
    coll.all_gather_into_tensor(out, shard)
    want = torch.cat([torch.arange(3.0) + 10 * r for r in range(n)])
    expect(torch.equal(out.cpu(), want), f"all_gather gave {out.cpu().tolist()}, expected {want.tolist()}")
    untouched(out_buf, 2, 2 + 3 * n, "all_gather")

    in_buf, res_buf = buffer(3 * n + 9), buffer(7)
    full = in_buf[5:5 + 3 * n]  # offset 5
    full.copy_(torch.arange(3.0 * n, device=dev) * (rank + 1))
    mine = res_buf[4:7]  # offset 4
    coll.reduce_scatter_tensor(mine, full, op="sum")
    want = torch.arange(3.0 * rank, 3.0 * rank + 3) * (n * (n + 1) / 2)
    expect(torch.equal(mine.cpu(), want), f"reduce_scatter gave {mine.cpu().tolist()}, expected {want.tolist()}")
    untouched(res_buf, 4, 7, "reduce_scatter")

    buf = buffer(9)
    view = buf[2:5]
    view.fill_(float(rank))
    coll.broadcast(view, src=n - 1)
    expect(torch.equal(view.cpu(), torch.full((3,), float(n - 1))), f"broadcast gave {view.cpu().tolist()}")
    untouched(buf, 2, 5, "broadcast")
    return "all_reduce, all_gather, reduce_scatter, broadcast on views at storage offsets 1-5"


# ---------------------------------------------------------------- a low-precision training step


def _tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 16, generator=gen), torch.randn(rows, 4, generator=gen)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in model.parameters()]


def train_step_check(backend: Backend, dtype: torch.dtype) -> str:
    """One SGD step under ``backend.autocast(dtype)`` (fp16: with ``backend.grad_scaler()``) against the
    fp32 step on the CPU; fp16 also checks that an overflowing step is skipped and the scale lowered."""
    dev = backend.device()
    reference = _tiny_model()
    model = copy.deepcopy(reference).to(dev)
    x, y = _data()
    before = _params(reference)
    ref_loss = _loss(reference(x), y)
    ref_loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            assert p.grad is not None  # every parameter takes part in the loss
            p.sub_(LR * p.grad)
    ref_update = [a - b for a, b in zip(_params(reference), before, strict=True)]

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = backend.grad_scaler() if dtype == torch.float16 else None
    with backend.autocast(dtype):
        out = model(x.to(dev))
    expect(out.dtype == dtype, f"the forward computed in {out.dtype}, not {dtype} (autocast did not apply)")
    loss = _loss(out, y.to(dev))
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        backend.mark_step()
    else:
        loss.backward()
        backend.optimizer_step(opt)
    update = [a - b for a, b in zip(_params(model), before, strict=True)]
    got, want = float(loss.detach()), float(ref_loss.detach())
    loss_err = abs(got - want) / abs(want)
    update_err = max(_relative(u, r) for u, r in zip(update, ref_update, strict=True))
    expect(loss_err <= 5e-2, f"loss {got:.5f}, the CPU fp32 step's {want:.5f}")
    expect(update_err <= 1e-1, f"the parameter update differs from the CPU fp32 step's by {update_err:.1e} (relative)")
    seen = f"step matches the CPU fp32 step (loss {loss_err:.0e}, update {update_err:.0e} relative)"
    if scaler is None:
        return seen
    return f"{type(scaler).__module__}.{type(scaler).__qualname__}: {seen}; " + _overflow_step(backend, model, opt, scaler)


def _overflow_step(backend: Backend, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> str:
    """A step whose fp16 gradients overflow must leave the parameters alone and lower the scale."""
    dev = backend.device()
    x, y = _data()
    before, scale = _params(model), scaler.get_scale()
    opt.zero_grad()
    with backend.autocast(torch.float16):
        out = model(x.to(dev))
    # a huge loss: its gradient overflows fp16 in the backward of the fp16 layers
    scaler.scale(_loss(out, y.to(dev)) * 1e30).backward()
    scaler.step(opt)
    scaler.update()
    backend.mark_step()
    after = _params(model)
    expect(all(torch.equal(a, b) for a, b in zip(after, before, strict=True)),
           "a step whose gradients overflowed changed the parameters: the scaler did not see the overflow")
    expect(scaler.get_scale() < scale, f"the scale stayed at {scaler.get_scale()} after an overflow")
    return f"an overflowing step was skipped, scale {scale:g} -> {scaler.get_scale():g}"


# ---------------------------------------------------------------- a ZeRO-3 step


def _two_unit_model(seed: int = 0) -> nn.Module:
    # with min_num_params=1000 the size policy makes the first Linear (1088 parameters) a unit and
    # leaves the last (260) to the root unit: two units
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def stage3_check(backend: Backend, coll: Collectives, world_size: int, rank: int) -> str:
    """A stage-3 step of a two-unit model, each rank on its rows, against the whole batch on the CPU."""
    from xshard.sharding import ShardingOptions, shard_model

    dev = backend.device()
    x, y = _data(rows=4 * world_size)
    reference = _two_unit_model()
    ref_losses = []
    for _ in range(2):
        loss = _loss(reference(x), y)
        ref_losses.append(float(loss.detach()))
        reference.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                assert p.grad is not None  # every parameter takes part in the loss
                p.sub_(LR * p.grad)

    model = shard_model(_two_unit_model(), backend,
                        ShardingOptions(stage=3, auto_wrap_policy="size", min_num_params=1000))
    try:
        units = model.stats()["units"]
        expect(units == 2, f"the model was split into {units} unit(s), not 2")
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        mine = slice(4 * rank, 4 * rank + 4)
        losses = []
        for _ in range(2):
            loss = _loss(model(x[mine].to(dev)), y[mine].to(dev))
            opt.zero_grad()
            loss.backward()
            backend.optimizer_step(opt)
            mean = loss.detach().reshape(1).float().clone()
            coll.all_reduce(mean, op="avg")
            losses.append(float(mean.cpu()))
    finally:
        model.close()
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        expect(abs(got - want) <= 1e-3 * abs(want) + 1e-5,
               f"step {step}: loss {got:.6f} over {world_size} rank(s), plain PyTorch {want:.6f}")
    return f"2 units over {world_size} rank(s): losses {losses[0]:.5f} -> {losses[1]:.5f} as plain PyTorch"
