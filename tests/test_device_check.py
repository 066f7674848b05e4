"""The device check (benchmarks/device_check.py) keeps working where no accelerator is: its CPU form runs every
part's code path small, writes a report of the promised structure, and its correctness part passes; bad input is
one line and exit code 2; the comparison it passes on fails a run whose gradients are off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_check.py"
PARTS = {"correctness", "syncs", "speed", "async_save", "offload"}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _run(*args: str, timeout: float = 260, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("device-check")
    done = _run("--device", "cpu", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "report.md").read_text().startswith("# Device check")
    return json.loads((out / "report.json").read_text())


def test_cpu_form_reports_every_part_and_the_machine(report) -> None:
    assert set(report["parts"]) == PARTS
    assert {"torch", "device", "count"} <= set(report["machine"])
    assert report["tolerances"]["fp32"]["weight_atol"] == 1e-5 and "bf16" in report["tolerances"]
    assert any("idle share" in reason for reason in report["not_run"])  # what the CPU cannot measure is named
    for name, part in report["parts"].items():
        assert part["seconds"] <= part["budget_s"] + 30, name
        assert not part["summary"]["errors"], (name, part["summary"]["errors"])


def test_cpu_form_correctness_passes_for_every_configuration(report) -> None:
    results = report["parts"]["correctness"]["results"]
    compared = {name: r for name, r in results.items() if name.startswith("xshard")}
    # stages 0 and 3, fp32 and bf16, with activation checkpointing, and CPU offload at stage 3
    assert len(compared) == 10 and {"xshard-3 bf16 offload", "xshard-0 fp32 checkpointing"} <= set(compared)
    assert all(r["passed"] for r in compared.values()), compared
    assert report["parts"]["correctness"]["summary"]["passed"] is True


def test_cpu_form_measures_syncs_speed_saves_and_offload(report) -> None:
    parts = report["parts"]
    assert parts["syncs"]["summary"]["from_xshard"] == 0, parts["syncs"]["results"]
    speed = parts["speed"]["results"]
    assert set(speed) == {"plain PyTorch", "FSDP2", "xshard-0", "xshard-3", "Accelerate"}
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is not None for r in speed.values()), speed
    saves = parts["async_save"]["results"]["xshard-3 sharded"]
    # both ways of saving were measured (their ratio is for a device: a stall this small is noise on 2 busy cores)
    assert len(saves["stalls_s"]["blocking"]) == len(saves["stalls_s"]["async"]) == 1, saves
    assert parts["offload"]["summary"]["slowdown"] > 0


def test_the_comparison_fails_a_run_with_wrong_gradients() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from device_check_workers import compare

    state = {"w": torch.ones(3)}
    reference = {"losses": [1.0, 0.5], "norms": [2.0, 1.0], "state": {"w": torch.ones(3)}}
    assert compare([1.0, 0.5], [2.0, 1.0], state, reference, "fp32")["passed"]
    assert not compare([1.0, 0.5], [4.0, 2.0], state, reference, "fp32")["passed"]  # gradients 2x
    assert not compare([1.0, 0.5], [2.0, 1.0], {"w": torch.ones(3) + 1e-3}, reference, "fp32")["passed"]
    assert compare([1.0, 0.5], [2.0, 1.0], {"w": torch.ones(3) + 1e-3}, reference, "bf16")["passed"]


def test_a_device_sync_warning_is_put_on_the_innermost_frame_of_xshard() -> None:
    """The GPU form's attribution: torch's sync warning, raised below xshard's code, names xshard's line."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from device_check_probes import SyncCounter

    from xshard.sharding.trees import map_tensors

    counter = SyncCounter(torch.device("cpu"))
    counter.counting = True

    def reads_the_device(t: torch.Tensor) -> torch.Tensor:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = counter._on_warning
        map_tensors([torch.ones(1)], reads_the_device)  # xshard's frame calls the reading function
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # not under xshard
    [(where, count)] = counter.xshard.items()
    assert where.startswith("xshard/sharding/trees.py:") and count == 1, counter.xshard
    assert sum(counter.other.values()) == 1 and all("test_device_check.py" in k for k in counter.other)


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "tpu"], "--device 'tpu' is not known: use one of cuda, npu, cpu"),
    (["--device", "cpu", "--parts", "speed", "--quick", "--hidden", "65536", "--layers", "64"],
     "lower --layers or --hidden"),
    (["--device", "cpu", "--parts", "warp"], "--parts warp: not a part"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, tmp_path) -> None:
    done = _run(*args, "--out", str(tmp_path), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "report.json").exists()


def test_absent_cuda_device_says_how_to_run_the_cpu_form(tmp_path) -> None:
    done = _run("--device", "cuda", "--out", str(tmp_path), timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr and "--device cpu --quick" in done.stderr, done.stderr
