"""The written Backend contract: every member the core and the Accelerator call is declared on the base
with a default, each built-in backend states its capabilities, each names its launcher, and nothing in
xshard/ probes a backend for undeclared members or tells device families apart by name."""

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
               "host_buffer"],
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


def test_each_backend_names_its_launcher(clean_env) -> None:
    assert isinstance(backend_class("xla")(World()).launcher(), XLALauncher)
    assert isinstance(backend_class("mps")(World()).launcher(), SingleLauncher)
    for name in ("cuda", "npu"):  # torchrun, the default
        assert backend_class(name).launcher is Backend.launcher


# ------------------------------------------------------------------ what xshard/ may not do

#: device-family, process-group and launcher names that no code outside backends/ compares against
FAMILY_NAMES = {"cpu", "cuda", "npu", "xla", "tpu", "mps", "gloo", "nccl", "hccl", "torchrun", "single"}
#: config readers compare keys and values of foreign config formats (DeepSpeed's offload "cpu", the HF
#: Trainer's "xla" key), which are words of those formats, not device checks
FOREIGN_FORMATS = ROOT / "xshard" / "config"
#: places in the sharded core that still probe or name a device; the core moves to the declared
#: members (frees_storage_by_resize, optimizer_step_patch) and this list is then emptied
PENDING: set[tuple[str, str]] = set()


def _violations() -> set[tuple[str, str]]:
    found = set()
    for path in sorted((ROOT / "xshard").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and \
                    node.func.id in ("getattr", "hasattr", "isinstance") and "backend" in ast.unparse(node.args[0]):
                found.add((rel, ast.unparse(node)))
            elif isinstance(node, ast.Compare) and not path.is_relative_to(FOREIGN_FORMATS):
                for side in (node.left, *node.comparators):
                    items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value.lower() in FAMILY_NAMES
                           for i in items):
                        found.add((rel, ast.unparse(node)))
    return found


def test_xshard_uses_only_declared_members_and_names_no_device_family() -> None:
    assert _violations() - PENDING == set()


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
