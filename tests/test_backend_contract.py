"""The written Backend contract: every member the core and the Accelerator call is declared on the base
with a default, each built-in backend states its capabilities and device facts, each names its launcher, and
nothing in xshard/ outside the device layer probes a backend for undeclared members, tells device families apart
by name, keeps a table by device family or reaches a family's module (torch.cuda, torch_xla ...); a backend
defined outside xshard reaches every caller of those facts."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xshard.backends import Backend, SingleProcessCollectives, StepPatch, World, backend_class
from xshard.backends.launchers import SingleLauncher, TorchrunLauncher, XLALauncher

ROOT = Path(__file__).resolve().parent.parent

#: what the core and the Accelerator may call (backends/README.md describes each one)
CONTRACT = {
    "identity": ["name", "device_type", "dist_backend", "visible_devices_env", "native_avg", "max_world_size",
                 "vendor_module", "install_hint", "related_env_vars"],
    "probing": ["unavailable_reason", "is_available", "auto_skip_reason", "vendor_version", "runtime_initialized",
                "format_visible_devices", "default_env", "apply_default_env", "describe"],
    "device": ["device", "set_device", "device_count", "host_device_count", "synchronize", "manual_seed",
               "rng_state", "set_rng_state", "memory_stats", "reset_peak_memory_stats", "supports", "autocast",
               "grad_scaler", "checkpoint_wrapper", "wrap_dataloader", "mark_step", "optimizer_step",
               "optimizer_step_patch", "frees_storage_by_resize", "compiles_graphs", "pins_host_memory", "trainer_device_count",
               "runs_hub_kernels",
               "host_buffer", "device_name", "free_memory", "empty_cache", "peak_tflops", "measured_peak_tflops",
               "accelerate_distributed_type"],
    "communication": ["init_process_group", "destroy_process_group", "collectives", "local_collectives",
                      "process_group_options", "collective_options", "group_collectives", "check_world",
                      "world_size_hint"],
    "launching": ["launcher"],
}


@pytest.mark.parametrize("role", sorted(CONTRACT))
def test_every_member_is_declared_on_the_base_class(role) -> None:
    missing = [m for m in CONTRACT[role] if not hasattr(Backend, m)]
    assert missing == []


def test_the_defaults_suit_an_eager_device_with_a_process_group(clean_env) -> None:
    cpu = backend_class("cpu")(World())
    assert (Backend.frees_storage_by_resize, Backend.compiles_graphs) == (True, False)
    patch = cpu.optimizer_step_patch()
    assert type(patch) is StepPatch and patch.active
    with cpu.optimizer_step_patch() as scoped:  # a context manager that restores on exit
        assert type(scoped) is StepPatch
    assert not scoped.active
    local = cpu.local_collectives()
    assert isinstance(local, SingleProcessCollectives) and (local.rank, local.world_size) == (0, 1)
    assert isinstance(cpu.grad_scaler(), torch.amp.GradScaler)
    assert isinstance(cpu.launcher(), TorchrunLauncher) and cpu.launcher().backend is cpu


@pytest.mark.parametrize("name,frees_by_resize,compiles", [
    ("cpu", True, False), ("cuda", True, False), ("npu", True, False), ("mps", True, False), ("xla", False, True),
])
def test_each_backend_states_its_capabilities(name, frees_by_resize, compiles) -> None:
    cls = backend_class(name)
    assert (cls.frees_storage_by_resize, cls.compiles_graphs) == (frees_by_resize, compiles)


@pytest.mark.parametrize("name,distributed_type,peak_models", [
    ("cpu", "MULTI_CPU", set()), ("cuda", "MULTI_GPU", {"A100", "H100", "H100 PCIe", "H200", "B200", "MI300X"}),
    ("npu", "MULTI_NPU", {"Ascend910B", "Ascend910C"}), ("mps", "MULTI_MPS", set()),
    ("tpu", "MULTI_TPU", {"TPU v4", "TPU v5e", "TPU v5p", "TPU v6e", "TPU v7"}),
    ("xla", "XLA", {"TPU v4", "TPU v5e", "TPU v5p", "TPU v6e", "TPU v7"}),
])
def test_each_backend_states_its_device_facts(name, distributed_type, peak_models) -> None:
    """The facts callers outside backends/ ask for: Accelerate's name for the family, the published peaks."""
    cls = backend_class(name)
    assert cls.accelerate_distributed_type() == distributed_type
    assert set(cls.peak_tflops.figures) == peak_models
    assert {model for _words, model in cls.peak_tflops.models} == peak_models


def test_each_backend_names_its_launcher(clean_env) -> None:
    assert isinstance(backend_class("xla")(World()).launcher(), XLALauncher)
    assert isinstance(backend_class("mps")(World()).launcher(), SingleLauncher)
    for name in ("cuda", "npu"):  # torchrun, the default
        assert backend_class(name).launcher is Backend.launcher


# ------------------------------------------------------------------ what xshard/ may not do

#: device-family, process-group and launcher names that no code outside backends/ compares against
FAMILY_NAMES = {"cpu", "cuda", "npu", "xla", "tpu", "mps", "gloo", "nccl", "hccl", "torchrun", "single"}
#: the device families alone, which no table outside backends/ is keyed by
DEVICE_FAMILIES = {"cpu", "cuda", "npu", "xla", "tpu", "mps", "xpu"}
#: config readers compare keys and values of foreign config formats (DeepSpeed's offload "cpu", the HF
#: Trainer's "xla" key), which are words of those formats, not device checks
FOREIGN_FORMATS = ROOT / "xshard" / "config"
#: places in the sharded core that still probe or name a device; the core moves to the declared
#: members (frees_storage_by_resize, optimizer_step_patch) and this list is then emptied
PENDING: set[tuple[str, str]] = set()
#: names that are not device checks, each with its reason
NOT_A_DEVICE_CHECK: dict[tuple[str, str], str] = {
    ("xshard/accelerate_compat/profiling.py", "{'cpu': torch.profiler.ProfilerActivity.CPU}"):
        "torch.profiler's host activity, which every job records whatever its device (the device's own activity is "
        "looked up by the backend's device_type)",
}


def _violations() -> set[tuple[str, str]]:
    found = set()
    for path in sorted((ROOT / "xshard").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and \
                    node.func.id in ("getattr", "hasattr", "isinstance") and "backend" in ast.unparse(node.args[0]):
                found.add((rel, ast.unparse(node)))
            elif isinstance(node, ast.Dict) and not path.is_relative_to(FOREIGN_FORMATS) and any(
                    isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.lower() in DEVICE_FAMILIES
                    for k in node.keys):  # a table keyed by device family (a fact that belongs on the Backend)
                found.add((rel, ast.unparse(node)))
            elif isinstance(node, ast.Compare) and not path.is_relative_to(FOREIGN_FORMATS):
                for side in (node.left, *node.comparators):
                    items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value.lower() in FAMILY_NAMES
                           for i in items):
                        found.add((rel, ast.unparse(node)))
    return found


def test_xshard_uses_only_declared_members_and_names_no_device_family() -> None:
    assert _violations() - PENDING - set(NOT_A_DEVICE_CHECK) == set()
    assert set(NOT_A_DEVICE_CHECK) <= _violations()  # no stale entry


#: the device families' torch modules (``torch.cuda`` ...) and torch's per-family switches (``torch.backends.cuda``)
TORCH_FAMILY_MODULES = {"cuda", "npu", "xpu", "mps", "tpu", "xla", "mlu", "hpu", "musa", "cudnn", "mkldnn"}
#: the vendors' own packages
VENDOR_PACKAGES = {"torch_xla", "torch_npu", "torch_tpu", "intel_extension_for_pytorch", "torch_mlu", "habana_frameworks"}
BACKENDS = ROOT / "xshard" / "backends"
#: (file, what it names) outside backends/ that may name a device family's module, each with its reason; empty:
#: every device fact is a Backend member
DEVICE_MODULE_ALLOWED: dict[tuple[str, str], str] = {}


def _names_a_device_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] in VENDOR_PACKAGES:
        return True
    if parts[0] != "torch" or len(parts) < 2:
        return False
    return parts[1] in TORCH_FAMILY_MODULES or (parts[1] == "backends" and len(parts) > 2
                                                 and parts[2] in TORCH_FAMILY_MODULES)


def _dotted(node: ast.AST) -> str | None:
    """``torch.cuda.empty_cache`` for the expression ``torch.cuda.empty_cache``; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def device_module_uses(tree: ast.AST) -> set[str]:
    """What a module names of the device families' modules: ``torch.<family>`` (and ``torch.backends.<family>``)
    attributes, imports of them or of a vendor package, and a vendor package named to ``import_module`` /
    ``find_spec`` / ``getattr(torch, "cuda")``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and _names_a_device_module(dotted):
                found.add(".".join(dotted.split(".")[:3 if dotted.startswith("torch.backends.") else 2]))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _names_a_device_module(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if _names_a_device_module(node.module) or _names_a_device_module(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Call):
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) > 1 \
                    and ast.unparse(node.args[0]) == "torch":
                found |= {f"torch.{v}" for v in strings[:1] if v in TORCH_FAMILY_MODULES}
            else:
                found |= {v for v in strings if _names_a_device_module(v)}
    return found


def _device_module_uses_outside_backends() -> set[tuple[str, str]]:
    found = set()
    for path in sorted((ROOT / "xshard").rglob("*.py")):
        if path.is_relative_to(BACKENDS):  # the device layer is where they belong
            continue
        rel = path.relative_to(ROOT).as_posix()
        found |= {(rel, use) for use in device_module_uses(ast.parse(path.read_text(encoding="utf-8")))}
    return found


def test_no_device_family_module_is_named_outside_the_device_layer() -> None:
    """Adding a backend touches backends/ and the docs only: nothing else reaches torch.cuda, torch.npu, torch_xla ..."""
    assert _device_module_uses_outside_backends() - set(DEVICE_MODULE_ALLOWED) == set()
    assert set(DEVICE_MODULE_ALLOWED) <= _device_module_uses_outside_backends()  # no stale entry


def test_the_scan_sees_each_way_of_reaching_a_device_module() -> None:
    source = """
import torch, torch_xla.core.xla_model as xm
from torch_npu.contrib import transfer_to_npu
from torch import cuda
import importlib
torch.cuda.empty_cache()
x = torch.backends.mps.is_available()
importlib.import_module("torch_tpu")
getattr(torch, "xpu")
torch.float16, torch.device("cuda"), torch.accelerator.device_count()
"""
    assert device_module_uses(ast.parse(source)) == {
        "torch_xla.core.xla_model", "torch_npu.contrib.transfer_to_npu", "torch.cuda", "torch.backends.mps",
        "torch_tpu", "torch.xpu"}


THREADED_IMPORT = """
import threading
errors = []
def first_import():
    try:
        from xshard.backends import get_backend  # noqa: F401
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=first_import) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors)
"""


def test_replica_threads_importing_the_backends_at_once_see_the_whole_module() -> None:
    """XLA:CPU replicas are threads of one process: their first `import xshard.backends` may coincide."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):  # a fresh interpreter each time: only a first import can race
        out = subprocess.run([sys.executable, "-c", THREADED_IMPORT], env=env, cwd=ROOT / "tests",
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
