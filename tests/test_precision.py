"""Mixed precision, owned by ``xshard.runtime.mixed_precision.Precision``: what it guarantees, against plain PyTorch.

One process on the CPU (which computes in bf16 and fp16 under autocast). The reference is the same
loop written with ``torch.autocast`` and ``torch.amp.GradScaler``: an fp16 step whose gradients
overflow is skipped and the scale lowered as torch.amp does; bf16 computes in bf16 with fp32 master
weights; a prepared model returns fp32 outputs under mixed precision; a bad spelling's error names the
accepted ones. The multi-rank overflow verdict is tested in test_accelerator.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(STEPS)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, overflow: bool) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x).float(), y)
    return loss * float("inf") if overflow else loss


def _xshard_run(precision: str, overflow_at: int | None = None, init_scale: float = 64.0):
    """Params after each step, the scale after each step (fp16) and which steps were skipped."""
    import xshard

    acc = xshard.Accelerator(config={"stage": 0, "mixed_precision": precision}, seed=0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    if acc.scaler is not None:
        acc.scaler.load_state_dict({"scale": init_scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                                    "growth_interval": 2000, "_growth_tracker": 0})
    params, scales, skipped = [], [], []
    for i, (x, y) in enumerate(_batches()):
        with acc.accumulate(model), acc.autocast():
            acc.backward(_loss(model, x, y, i == overflow_at))
            opt.step()
            opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        scales.append(acc.scaler.get_scale() if acc.scaler is not None else None)
        skipped.append(acc.optimizer_step_was_skipped)
    acc.end()
    return params, scales, skipped


def _torch_run(dtype: torch.dtype, overflow_at: int | None = None, init_scale: float = 64.0):
    """The same steps in plain PyTorch: torch.autocast, and torch.amp.GradScaler for fp16."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == torch.float16 else None
    params, scales, skipped = [], [], []
    for i, (x, y) in enumerate(_batches()):
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=dtype):
            loss = _loss(model, x, y, i == overflow_at)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        scales.append(scaler.get_scale() if scaler is not None else None)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, params[-1], strict=True)))
    return params, scales, skipped


def _assert_same_params(ours, theirs) -> None:
    for step, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
        for a, b in zip(mine, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"after step {step}")


def test_fp16_overflow_skips_the_step_and_lowers_the_scale_as_torch_amp(clean_env):
    params, scales, skipped = _xshard_run("fp16", overflow_at=1)
    ref_params, ref_scales, ref_skipped = _torch_run(torch.float16, overflow_at=1)
    assert skipped == ref_skipped == [False, True, False]
    assert scales == ref_scales == [64.0, 32.0, 32.0]
    _assert_same_params(params, ref_params)
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1], strict=True))  # the skipped step


def test_bf16_computes_in_bf16_with_fp32_master_weights_as_torch_autocast(clean_env):
    params, _, skipped = _xshard_run("bf16")
    ref_params, _, _ = _torch_run(torch.bfloat16)
    assert skipped == [False] * STEPS
    assert all(p.dtype == torch.float32 for p in params[-1])
    _assert_same_params(params, ref_params)


def test_the_precision_object_holds_the_dtypes_and_the_scaler(clean_env):
    import xshard

    acc = xshard.Accelerator(config={"stage": 3, "mixed_precision": "bfloat16"}, seed=0)
    assert (acc.mixed_precision, acc.precision.compute_dtype, acc.precision.output_dtype) == (
        "bf16", torch.bfloat16, torch.float32)
    assert acc.scaler is None and acc.job.scaler is None
    model = acc.prepare(_model())
    x = torch.randn(4, 8)
    with acc.autocast():
        out = model(x)
        inner = nn.Linear(8, 2)(x)
    # inside the forward the layers compute in bf16, as under torch.autocast; the model hands back fp32
    assert inner.dtype == torch.bfloat16
    assert out.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _model()(x).dtype == torch.bfloat16  # plain autocast would hand back bf16
    acc.end()

    acc = xshard.Accelerator(config={"stage": 0}, mixed_precision="fp16", seed=0)
    assert (acc.precision.name, acc.precision.compute_dtype, acc.precision.output_dtype) == (
        "fp16", torch.float16, torch.float32)
    assert acc.scaler is acc.precision.scaler is acc.job.scaler
    assert isinstance(acc.scaler, torch.amp.GradScaler)
    acc.mixed_precision = "no"  # before the first prepare(model): fp32, no scaler
    assert (acc.precision.compute_dtype, acc.precision.output_dtype, acc.scaler) == (None, None, None)
    assert acc.config.mixed_precision == "no"
    acc.end()


@pytest.mark.parametrize("spelling, name", [
    ("no", "no"), ("fp32", "no"), ("FLOAT32", "no"), ("torch.float32", "no"),
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"), ("torch.float16", "fp16"),
])
def test_every_accepted_spelling_reads_the_same_everywhere(spelling, name):
    from xshard.cli.launch import _mixed_precision
    from xshard.config import XShardConfig

    assert XShardConfig(mixed_precision=spelling).mixed_precision == name
    assert _mixed_precision(spelling) == name
    accelerate_file = {"distributed_type": "MULTI_CPU", "mixed_precision": spelling}  # what `accelerate config` writes
    assert XShardConfig.load(accelerate_file, env={}).mixed_precision == name


def test_accelerates_enum_and_old_fp16_flag_read_as_their_names(clean_env):
    import xshard
    from xshard.utils import PrecisionType

    acc = xshard.Accelerator(config={"stage": 0}, mixed_precision=PrecisionType.BF16)
    assert acc.mixed_precision == "bf16"
    acc.end()
    acc = xshard.Accelerator(config={"stage": 0}, fp16=True)
    assert acc.mixed_precision == "fp16" and acc.scaler is not None
    acc.end()


@pytest.mark.parametrize("spelling", ["half", "fp64", "int8", "", 16])
def test_a_bad_spelling_is_refused_naming_the_accepted_ones(clean_env, spelling):
    import xshard
    from xshard.config import XShardConfig, XShardConfigError

    with pytest.raises(XShardConfigError, match=r"mixed_precision: .* is not valid; expected one of no, bf16, fp16"):
        XShardConfig(mixed_precision=spelling)
    with pytest.raises(ValueError, match=r"expected one of no, bf16, fp16"):
        xshard.Accelerator(config={"stage": 0}, mixed_precision=spelling)


def test_fp8_says_it_is_not_supported(clean_env):
    from xshard.backends.launchers import LaunchError
    from xshard.cli.launch import _mixed_precision
    from xshard.config import XShardConfig, XShardConfigError

    with pytest.raises(XShardConfigError, match=r"expected one of no, bf16, fp16 \(fp8 is not supported by xshard\)"):
        XShardConfig(mixed_precision="fp8")
    with pytest.raises(LaunchError, match=r"fp8 is not supported by xshard; use no, bf16 or fp16"):
        _mixed_precision("FP8")


def test_the_fp16_scale_is_saved_and_restored_with_the_state(clean_env, tmp_path):
    import xshard

    acc = xshard.Accelerator(config={"stage": 0, "mixed_precision": "fp16"}, seed=0)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.scaler.load_state_dict({"scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 2000, "_growth_tracker": 0})
    x, y = _batches()[0]
    with acc.accumulate(model):
        acc.backward(_loss(model, x, y, overflow=True))  # the skipped step halves the scale: 32
        opt.step()
        opt.zero_grad()
    acc.save_state(str(tmp_path / "state"))
    acc.scaler.update(1024.0)
    acc.load_state(str(tmp_path / "state"))
    assert acc.scaler.get_scale() == 32.0
    acc.end()
