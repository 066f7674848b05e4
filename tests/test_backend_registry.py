"""Backends that live outside the package: registered in code or by an installed package's entry point,
selected by name, and run through the Accelerator like a built-in one (tests/support/toy_backend.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.toy_backend import ToyBackend

import xshard.backends as backends
from xshard.backends import (
    BackendConflictError,
    BackendUnavailableError,
    UnknownBackendError,
    register_backend,
    select,
    unregister_backend,
)

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def registry(clean_env):
    """A registry with no registered backends, entry points not yet read; restored afterwards."""
    clean_env.setattr(backends, "_registered", {})
    clean_env.setattr(backends, "_entry_points_read", True)
    return clean_env


def _plugin(folder: Path, target: str = "support.toy_backend:ToyBackend", name: str = "toy") -> Path:
    """What `pip install` of a package declaring ``[project.entry-points."xshard.backends"]`` leaves."""
    info = folder / f"{name}_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[xshard.backends]\n{name} = {target}\n")
    return folder


def test_a_registered_class_is_selected_by_name_and_runs_the_defaults(registry) -> None:
    register_backend("toy", ToyBackend)
    register_backend("toy", ToyBackend)  # the same registration again changes nothing
    assert "toy" in backends.names() and "toy" not in backends.AUTO_ORDER
    registry.setenv("XSHARD_BACKEND", "TOY")
    selection = select()
    assert selection.cls is ToyBackend and selection.reason == "XSHARD_BACKEND=TOY"
    backend = selection.cls()
    assert backend.launcher().name == "torchrun" and backend.host_device_count() == 1
    assert backend.frees_storage_by_resize and not backend.compiles_graphs
    with backend.optimizer_step_patch() as patch:
        assert patch.active
    assert not patch.active
    t = torch.arange(4.0)
    backend.local_collectives().all_reduce(t, op="avg")
    assert torch.equal(t, torch.arange(4.0))
    assert isinstance(backend.grad_scaler(), torch.amp.GradScaler)


def test_auto_never_picks_a_registered_backend(registry) -> None:
    register_backend("toy", ToyBackend)
    assert select().name != "toy"


def test_the_config_file_may_name_a_registered_backend(registry) -> None:
    from xshard.config import XShardConfig, XShardConfigError

    with pytest.raises(XShardConfigError, match="backend"):
        XShardConfig.load({"backend": "toy"})
    register_backend("toy", "support.toy_backend:ToyBackend")
    assert XShardConfig.load({"backend": "toy"}).backend == "toy"


@pytest.mark.parametrize("name,target,error,message", [
    ("cpu", ToyBackend, BackendConflictError, "'cpu' is a built-in name"),
    ("auto", ToyBackend, BackendConflictError, "built-in name"),
    ("Toy Backend", ToyBackend, UnknownBackendError, "lowercase letters"),
    ("other", ToyBackend, UnknownBackendError, "name attribute is 'toy'; set name = 'other'"),
    ("toy", torch.nn.Linear, UnknownBackendError, "not a subclass of xshard.backends.Backend"),
    ("toy", "toy_backend.ToyBackend", UnknownBackendError, "'module:Class'"),
])
def test_bad_registrations_say_what_to_fix(registry, name, target, error, message) -> None:
    with pytest.raises(error, match=message):
        register_backend(name, target)


def test_a_name_taken_by_another_class_is_refused_until_unregistered(registry) -> None:
    register_backend("toy", ToyBackend)
    with pytest.raises(BackendConflictError, match="already registered as support.toy_backend:ToyBackend"):
        register_backend("toy", "elsewhere:ToyBackend")
    unregister_backend("toy")
    register_backend("toy", "elsewhere:ToyBackend")
    with pytest.raises(BackendUnavailableError, match="registered as 'elsewhere:ToyBackend', which cannot be loaded"):
        select("toy")


def test_an_installed_entry_point_is_found_and_a_broken_one_is_named(registry, tmp_path, caplog) -> None:
    registry.syspath_prepend(str(_plugin(tmp_path / "good")))
    registry.syspath_prepend(str(_plugin(tmp_path / "bad", target="no_colon", name="broken")))
    registry.setattr(backends, "_entry_points_read", False)
    assert "toy" in backends.names() and "broken" not in backends.names()
    assert "ignoring the xshard.backends entry point 'broken'" in caplog.text
    assert select("toy").cls is ToyBackend


TRAIN = r'''
import json, sys
import torch
from torch import nn
import xshard

acc = xshard.Accelerator(config={"stage": 3, "auto_wrap_policy": "none", "seed": 0})
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = acc.prepare(model, optimizer)
g = torch.Generator().manual_seed(10 + acc.rank)
x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
losses = []
for _ in range(3):
    loss = nn.functional.mse_loss(model(x.to(acc.device)), y.to(acc.device))
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(acc.reduce(loss.detach()).item())
weights = {k: v.tolist() for k, v in acc.full_state_dict(model).items()}
if acc.is_main_process:
    with open(sys.argv[1], "w") as f:
        json.dump({"backend": type(acc.backend).__name__, "world": acc.world_size, "losses": losses,
                   "weights": weights}, f)
acc.end()
'''


@pytest.mark.multiprocess
def test_the_toy_backend_trains_on_two_ranks_like_the_cpu_backend(tmp_path, clean_env) -> None:
    """Installed as a package would install it, the toy backend runs `xshard launch` and a sharded
    training step on 2 ranks; losses and weights match the cpu backend's."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    plugin = _plugin(tmp_path / "site")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(plugin), str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    results = {}
    for name in ("toy", "cpu"):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(script), str(out)],
                              env={**env, "XSHARD_BACKEND": name}, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = json.loads(out.read_text())
    toy, cpu = results["toy"], results["cpu"]
    assert (toy["backend"], toy["world"], cpu["backend"]) == ("ToyBackend", 2, "CPUBackend")
    assert toy["losses"][-1] < toy["losses"][0]
    torch.testing.assert_close(toy["losses"], cpu["losses"], rtol=1e-6, atol=1e-7)
    for key, value in cpu["weights"].items():
        torch.testing.assert_close(torch.tensor(toy["weights"][key]), torch.tensor(value), rtol=1e-6, atol=1e-7)
