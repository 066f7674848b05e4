"""`xshard env --check`: the self-test a user runs on real hardware.

``run_checks`` first reads the job's settings as every job started here would (``job_settings``), then has
the backend start its process group (a real one-rank group for one process, so
that the collective library itself runs; or the world torchrun started), runs each of the backend's
collectives and compares with the expected values, also on views at storage offsets, runs a matmul
in fp32 and in every low precision the device supports against the same product on the CPU, a
training step in each of those precisions (fp16 with the backend's own GradScaler, including an
overflowing step), and a ZeRO-3 step of a two-unit model against plain PyTorch (see
``env_check_training``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from xshard.backends import Backend, Collectives
from xshard.cli.env_check_training import CheckFailed, expect, stage3_check, train_step_check, views_check


@dataclass
class CheckResult:
    """One self-test: its name, whether it passed, and what it saw."""

    name: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_checks(backend: Backend, timeout: float = 60.0) -> list[CheckResult]:
    """Start the process group, run every collective and a matmul per precision; tear down."""
    results: list[CheckResult] = []

    def check(name: str, fn: Callable[[], str]) -> bool:
        try:
            results.append(CheckResult(name, True, fn()))
            return True
        except Exception as exc:
            message = str(exc) if isinstance(exc, CheckFailed) else f"{type(exc).__name__}: {exc}"
            results.append(CheckResult(name, False, message))
            return False

    check("job_settings", job_settings)
    world = backend.world
    grouped = check("process_group", lambda: _start_group(backend, timeout))
    if grouped:
        collectives = backend.collectives
        for name, fn in _collective_checks(backend, collectives):
            check(name, fn)
        check("collectives_on_views",
              lambda: views_check(backend, collectives, collectives.world_size, world.rank))
    else:
        for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "collectives_on_views"):
            results.append(CheckResult(name, False, "not run: the process group did not start"))
    check("matmul_fp32", lambda: _matmul(backend, None))
    low = [dtype for dtype in (torch.bfloat16, torch.float16) if backend.supports(dtype)]
    for dtype in low:
        check(f"matmul_autocast_{_short(dtype)}", functools.partial(_matmul, backend, dtype))
    for dtype in low:
        check(f"train_step_{_short(dtype)}", functools.partial(train_step_check, backend, dtype))
    if grouped or world.world_size == 1:
        # the sharded core reduces over the backend's own collectives (one process: none needed)
        check("stage3_two_units", lambda: stage3_check(backend, backend.collectives, world.world_size, world.rank))
    else:
        results.append(CheckResult("stage3_two_units", False, "not run: the process group did not start"))
    def synchronize() -> str:
        backend.synchronize()
        return "device queue drained"

    check("synchronize", synchronize)
    try:
        backend.destroy_process_group()
    except Exception as exc:
        results.append(CheckResult("teardown", False, f"{type(exc).__name__}: {exc}"))
    return results


def job_settings(env: Mapping[str, str] | None = None) -> str:
    """The settings every job started here reads (``XSHARD_CONFIG``'s file, the ``XSHARD_<FIELD>`` variables):
    a value that would stop every job (``XSHARD_STAGE=7``, ``XSHARD_TIMEOUT=abc``) fails this check, in the
    config's own words."""
    from xshard.config import XShardConfig, XShardConfigError
    from xshard.config.schema import ENV_PREFIX, FIELD_NAMES

    env = os.environ if env is None else env
    try:
        config = XShardConfig.load(None, env=env)
    except XShardConfigError as exc:
        raise CheckFailed(str(exc)) from None
    names = [ENV_PREFIX + name.upper() for name in FIELD_NAMES] + ["XSHARD_CONFIG"]
    read = ", ".join(name for name in names if name in env) or "no XSHARD_* setting: the defaults"
    return (f"stage {config.stage}, mixed precision {config.mixed_precision}, timeout {config.timeout:g} s "
            f"(read {read})")


def _start_group(backend: Backend, timeout: float) -> str:
    backend.init_process_group(timeout=timeout, always=True)
    world = backend.world
    if backend.dist_backend is not None:
        return f"{backend.dist_backend}: rank {world.rank} of {world.world_size}"
    return f"no c10d process group ({backend.name} collectives, {world.world_size} process(es))"


def _collective_checks(backend: Backend, coll: Collectives) -> list[tuple[str, Callable[[], str]]]:
    n, rank = coll.world_size, backend.world.rank
    dev = backend.device()

    def all_reduce() -> str:
        t = torch.full((4,), float(rank + 1), device=dev)
        coll.all_reduce(t, op="avg")
        expected = (n + 1) / 2
        got = t.cpu()
        expect(torch.allclose(got, torch.full((4,), expected)), f"avg gave {got.tolist()}, expected {expected}")
        return f"avg over {n} rank(s) = {expected}"

    def all_gather() -> str:
        shard = torch.arange(3, dtype=torch.float32, device=dev) + 10 * rank
        out = torch.empty(3 * n, device=dev)
        coll.all_gather_into_tensor(out, shard)
        expected = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(n)])
        expect(torch.equal(out.cpu(), expected), f"gathered {out.cpu().tolist()}, expected {expected.tolist()}")
        return f"{n} shard(s) of 3 in rank order"

    def reduce_scatter() -> str:
        full = torch.arange(3 * n, dtype=torch.float32, device=dev) * (rank + 1)
        out = torch.empty(3, device=dev)
        coll.reduce_scatter_tensor(out, full, op="sum")
        expected = torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) * (n * (n + 1) / 2)
        expect(torch.allclose(out.cpu(), expected), f"got {out.cpu().tolist()}, expected {expected.tolist()}")
        return "sum, this rank's slice"

    def broadcast() -> str:
        t = torch.full((2,), float(rank), device=dev)
        coll.broadcast(t, src=n - 1)
        expect(torch.equal(t.cpu(), torch.full((2,), float(n - 1))), f"got {t.cpu().tolist()}, expected {n - 1}")
        coll.barrier()
        return f"from rank {n - 1}, then a barrier"

    return [("all_reduce", all_reduce), ("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
            ("broadcast", broadcast)]


def _short(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[dtype]


def _matmul(backend: Backend, dtype: torch.dtype | None) -> str:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=gen)
    b = torch.randn(64, 64, generator=gen)
    reference = a @ b
    dev = backend.device()
    with backend.autocast(dtype):
        product = a.to(dev) @ b.to(dev)
    want = torch.float32 if dtype is None else dtype
    expect(product.dtype == want, f"result dtype {product.dtype}, expected {want} (autocast did not apply)")
    got = product.float().cpu()
    # fp32 may use reduced-precision units (TF32 and the like); low precision keeps ~3 digits
    tolerance = 1e-2 if dtype is None else 6e-2
    err = float((got - reference).abs().max() / reference.abs().max())
    expect(err <= tolerance, f"relative error {err:.2e} > {tolerance:.0e} against the CPU product")
    return f"64x64 on {dev}, relative error {err:.1e}"
