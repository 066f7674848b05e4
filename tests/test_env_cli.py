"""`xshard env` as a user runs it: a subprocess, its output, its exit code, and never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.distributed import free_port

from xshard.backends import World
from xshard.cli.env_check import run_checks

ROOT = Path(__file__).resolve().parent.parent
BROKEN_NPU = Path(__file__).parent / "support" / "fakes" / "broken_npu"


def xshard_env(*args: str, env: dict[str, str] | None = None, module: tuple[str, ...] = ("-m", "xshard", "env"),
               timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("XSHARD_") and not k.endswith("_VISIBLE_DEVICES")
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    base["OMP_NUM_THREADS"] = "1"
    base.update(env or {})
    return subprocess.run([sys.executable, *module, *args], cwd=ROOT, env=base, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xshard env: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_cpu_report() -> None:
    proc = xshard_env(env={"XSHARD_BACKEND": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "backend        cpu  (selected by XSHARD_BACKEND=cpu)" in proc.stdout
    assert "dist backend   gloo" in proc.stdout
    assert f"torch {torch.__version__}" in proc.stdout
    assert "XSHARD_BACKEND=cpu" in proc.stdout


def test_json_report_parses() -> None:
    proc = xshard_env("--json", "--backend", "cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["backend"] == "cpu" and report["dist_backend"] == "gloo"
    assert report["selected_by"] == "backend='cpu' argument"
    assert report["world"] == {"rank": 0, "world_size": 1, "local_rank": 0}
    assert report["versions"]["torch"] == torch.__version__


def test_auto_with_a_broken_torch_npu_not_autoloaded_still_reports_cpu() -> None:
    proc = xshard_env("--json", env={"PYTHONPATH": str(BROKEN_NPU / "no_cann"), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    skipped = {s["backend"]: s["reason"] for s in report["skipped"]}
    if report["backend"] == "cpu":  # (the XLA environment would pick xla first)
        assert "libhccl.so" in skipped["npu"] and "set_env.sh" in skipped["npu"]


def installed_layout(tmp_path: Path) -> Path:
    """This source tree laid out as its wheel installs it: the xshard/backends link copied as the folder
    it points to (backends/ inside xshard/)."""
    shutil.copytree(ROOT / "xshard", tmp_path / "xshard", ignore=shutil.ignore_patterns("__pycache__"))
    assert not (tmp_path / "xshard" / "backends").is_symlink()
    return tmp_path


@pytest.mark.parametrize("variant,cause,fix", [
    ("no_cann", "ImportError: libhccl.so: cannot open shared object file", 'pip install "torch-npu=='),
    ("cuda_torch", "RuntimeError: Two accelerators cannot be used at the same time", "CPU build of torch"),
])
def test_a_broken_torch_npu_that_torch_autoloads_is_explained_in_one_line(tmp_path, variant, cause, fix) -> None:
    # with torch_npu installed, `import torch` loads it itself: the failure comes before any xshard code
    path = f"{installed_layout(tmp_path)}{os.pathsep}{BROKEN_NPU / variant}"
    proc = subprocess.run([sys.executable, "-m", "xshard", "env"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("xshard: error: import torch failed: torch auto-loads the installed device extension "
                           "torch_npu, which raised ")
    assert cause in line and fix in line and "export TORCH_DEVICE_BACKEND_AUTOLOAD=0" in line


@pytest.mark.parametrize("args,env,fragments", [
    ((), {"XSHARD_BACKEND": "gpu"}, ("XSHARD_BACKEND='gpu'", "valid values are")),
    (("--backend", "ipu"), {}, ("backend='ipu'", "valid values are")),
    (("--backend", "cuda"), {"XSHARD_BACKEND": "cpu"}, ("backend='cuda'", "XSHARD_BACKEND='cpu'")),
    ((), {"XSHARD_BACKEND": "npu", "PYTHONPATH": str(BROKEN_NPU / "cuda_torch"), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
     ("Two accelerators", "CPU build of torch")),
    ((), {"XSHARD_BACKEND": "npu", "PYTHONPATH": str(BROKEN_NPU / "no_cann"), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
     ("libhccl.so", "set_env.sh")),
    (("--backend", "cuda"), {}, ("built without CUDA",)),
    (("--devices", "0,-1"), {"XSHARD_BACKEND": "cpu"}, ("-1 is negative",)),
    ((), {"XSHARD_BACKEND": "cpu", "WORLD_SIZE": "two"}, ("WORLD_SIZE='two' is not an integer",)),
], ids=["unknown-env", "unknown-arg", "conflict", "npu-cuda-torch", "npu-no-cann", "cuda-missing", "bad-devices",
        "bad-world"])
def test_errors_are_one_line_and_exit_2(args, env, fragments) -> None:
    assert_one_line_error(xshard_env(*args, env=env), *fragments)


def test_npu_without_torch_npu() -> None:
    proc = xshard_env(env={"XSHARD_BACKEND": "npu"})
    if "torch_npu is installed" not in proc.stderr:  # a machine with a real torch_npu says so instead
        assert_one_line_error(proc, "torch_npu is not installed", 'pip install "torch-npu==', "set_env.sh")


CHECKS = ("job_settings", "process_group", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
          "collectives_on_views", "matmul_fp32", "matmul_autocast_bf16", "matmul_autocast_fp16", "train_step_bf16", "train_step_fp16",
          "stage3_two_units", "synchronize")


def test_check_passes_on_cpu_with_one_process() -> None:
    proc = xshard_env("--check", env={"XSHARD_BACKEND": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in CHECKS:
        assert f"PASS  {name}" in proc.stdout
    assert "FAIL" not in proc.stdout and f"all {len(CHECKS)} checks passed" in proc.stdout
    assert "torch.amp.grad_scaler.GradScaler: step matches the CPU fp32 step" in proc.stdout  # cpu's scaler
    assert "an overflowing step was skipped, scale 65536 -> 32768" in proc.stdout
    assert "2 units over 1 rank(s)" in proc.stdout


@pytest.mark.xla
def test_check_passes_on_xla_cpu() -> None:
    pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    proc = xshard_env("--check", env={"XSHARD_BACKEND": "xla", "PJRT_DEVICE": "CPU"}, timeout=270)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"all {len(CHECKS)} checks passed" in proc.stdout


@pytest.mark.multiprocess
def test_check_passes_under_torchrun_with_two_processes() -> None:
    proc = xshard_env(
        "--check", "--json", env={"XSHARD_BACKEND": "cpu"},
        module=("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                "-m", "xshard", "env"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    decoder, text, reports = json.JSONDecoder(), proc.stdout.strip(), []
    while text:
        report, end = decoder.raw_decode(text)
        reports.append(report)
        text = text[end:].strip()
    assert sorted(r["world"]["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["checks_passed"] is True
        group = next(c for c in report["checks"] if c["name"] == "process_group")
        assert group["detail"] == f"gloo: rank {report['world']['rank']} of 2"
        assert next(c for c in report["checks"] if c["name"] == "all_reduce")["detail"] == "avg over 2 rank(s) = 1.5"
        assert [c["name"] for c in report["checks"]] == list(CHECKS)
        stage3 = next(c for c in report["checks"] if c["name"] == "stage3_two_units")["detail"]
        assert stage3.startswith("2 units over 2 rank(s)") and stage3.endswith("as plain PyTorch")


def test_check_fails_and_exits_1_when_the_peer_never_comes() -> None:
    env = {"XSHARD_BACKEND": "cpu", "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = xshard_env("--check", "--timeout", "2", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL  process_group" in proc.stdout and "FAIL  all_reduce" in proc.stdout
    assert "FAIL  collectives_on_views" in proc.stdout and "FAIL  stage3_two_units" in proc.stdout
    assert "PASS  matmul_fp32" in proc.stdout and "PASS  train_step_fp16" in proc.stdout  # the device still works
    assert "FAILED: process_group" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_check_catches_an_autocast_that_does_nothing(clean_env) -> None:
    from xshard.backends import backend_class

    backend = backend_class("cpu")(World())
    real = backend.autocast
    clean_env.setattr(backend, "autocast", lambda dtype=None, enabled=True: real(None))
    results = {r.name: r for r in run_checks(backend)}
    assert not results["matmul_autocast_bf16"].passed
    assert "autocast did not apply" in results["matmul_autocast_bf16"].detail
    assert results["matmul_fp32"].passed and results["all_reduce"].passed


def test_check_catches_a_scaler_that_misses_an_overflow(clean_env) -> None:
    from xshard.backends import backend_class

    backend = backend_class("cpu")(World())
    clean_env.setattr(backend, "grad_scaler", lambda enabled=True: _BlindScaler("cpu"))
    results = {r.name: r for r in run_checks(backend)}
    assert not results["train_step_fp16"].passed
    assert "overflowed changed the parameters: the scaler did not see the overflow" in results["train_step_fp16"].detail
    assert results["train_step_bf16"].passed and results["stage3_two_units"].passed


class _BlindScaler(torch.amp.GradScaler):
    """A scaler whose overflow check sees nothing (as a chip whose overflow flag is never read)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        for flag in per_device.values():
            flag.zero_()
        return per_device


def test_check_catches_a_collective_that_ignores_a_view_s_offset(clean_env) -> None:
    from xshard.backends import backend_class

    cpu = backend_class("cpu")
    real = cpu._make_collectives

    def offset_blind(backend):
        coll = real(backend)
        all_reduce = coll.all_reduce

        def all_reduce_from_storage_start(tensor, op="sum"):
            base = tensor if tensor._base is None else tensor._base  # writes at the storage start
            start = base.view(-1)[:tensor.numel()]
            start.copy_(tensor.reshape(-1).clone())
            return all_reduce(start, op=op)

        coll.all_reduce = all_reduce_from_storage_start
        return coll

    clean_env.setattr(cpu, "_make_collectives", offset_blind)
    results = {r.name: r for r in run_checks(cpu(World()))}
    assert not results["collectives_on_views"].passed
    assert "all_reduce wrote outside its view" in results["collectives_on_views"].detail
