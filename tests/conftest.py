"""Shared test setup: tests run from the repository root, on CPU, with small thread counts."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# tests/ on sys.path, for ``from support.distributed import run_workers``: also in the processes the tests
# spawn (they inherit it) and in scripts run with PYTHONPATH=tests
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the helpers, scripts and fake vendor modules the tests use; none of them is a test
collect_ignore = ["support"]

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    """``XSHARD_REQUIRE_XLA=1`` (``make test-xla``): the environment must have torch_xla, whose absence would
    otherwise skip every xla test (``pytest.importorskip``, the one skip the suite keeps for a package). On an
    xdist worker: torchrun's port of this worker (the note below)."""
    import importlib.util

    if os.environ.get("XSHARD_REQUIRE_XLA") == "1" and importlib.util.find_spec("torch_xla") is None:
        raise pytest.UsageError("XSHARD_REQUIRE_XLA=1: torch_xla is not installed in this environment, so every xla "
                                "test would be skipped; build the XLA environment with `make install-xla`")
    worker = _xdist_worker_index(config)
    if worker is not None:
        os.environ.setdefault("PET_MASTER_PORT", str(_TORCHRUN_DEFAULT_PORT + 1 + worker))


# ---------------------------------------------------------------------------------------------- parallel runs
# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile`). On 2 cores the serial suite
# keeps the CPUs about two thirds busy: its tests mostly wait on the processes of the jobs they start.
#  - A file's tests stay on one worker (`loadfile`), so a module's fixtures (a job shared by its tests) run
#    once; and every file of the 2-rank parity cases goes to one worker, which runs their one shared job
#    (`world2` trains every parity case of the session it sees: on two workers it would run twice).
#  - Stock torchrun without `--standalone` or `--master_port` binds 29500 (the anchors run it as users do): each
#    worker gives torchrun a port of its own through torchrun's own variable, PET_MASTER_PORT.
_PARITY_GROUP = "the files of the shared 2-rank parity job (world2)"
#: torchrun's default rendezvous port; worker N gives torchrun the port N above it
_TORCHRUN_DEFAULT_PORT = 29500


def _xdist_worker_index(config) -> int | None:
    """This process's pytest-xdist worker number (``gw0`` -> 0), None outside a worker."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    return int(worker[2:]) if worker else None


@functools.cache
def _uses_parity_world(path: str) -> bool:
    """Does the test file at ``path`` (relative to the root) take the shared parity job's ``world2`` fixture?"""
    try:
        return re.search(r"\bworld2\b", (ROOT / path).read_text()) is not None
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a run without xdist (-p no:xdist) does not know it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the parity files as one unit (the note above); other modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ParityFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _PARITY_GROUP if _uses_parity_world(path) else path

    return ParityFilesTogether(config, log)


def _pytest_timeout(item: pytest.Item) -> float | None:
    """The seconds after which pytest-timeout ends ``item``: its closest ``timeout`` mark (which replaces the
    configured value for that test), else ``--timeout``, ``PYTEST_TIMEOUT`` or the ini's ``timeout``."""
    if not item.config.pluginmanager.hasplugin("timeout"):  # pytest-timeout absent or disabled (-p no:timeout)
        return None
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
    else:
        value = item.config.getoption("timeout", None) or os.environ.get("PYTEST_TIMEOUT") or item.config.getini("timeout")
    return float(value) if value else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The test's pytest-timeout deadline, from the moment its timer starts (setup included), for the helpers
    whose own timeouts must fire first (support/deadline.py)."""
    from support.deadline import set_deadline

    set_deadline(_pytest_timeout(item))
    try:
        return (yield)
    finally:
        set_deadline(None)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test leaves ``os.environ`` as it found it. Code under test may export variables (a backend's
    process group puts its world into torchrun's RANK/WORLD_SIZE/MASTER_* for c10d's rendezvous), and a
    later in-process Accelerator would otherwise join that world and wait for its peers."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def clean_env(monkeypatch):
    """Remove every variable that selects a backend or a device, so a test starts from nothing."""
    for name in list(os.environ):
        if name.startswith("XSHARD_") or name.endswith("_VISIBLE_DEVICES") or name in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "PJRT_DEVICE", "PYTORCH_ENABLE_MPS_FALLBACK", "PJRT_CPU_ASYNC_CLIENT", "USE_TORCH_XLA",
        ):
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def cpu_backend(clean_env):
    """The CPU backend with its one-process group (world size 1): what single-process sharding tests shard on."""
    from xshard.backends import get_backend

    backend = get_backend("cpu")
    backend.init_process_group()
    return backend


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 and its tokenizer, saved as a from_pretrained folder by the Qwen example's own
    tool (examples/qwen_finetune/tiny.py), built once for every test that trains it."""
    example = ROOT / "examples" / "qwen_finetune"
    out = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([sys.executable, str(example / "tiny.py"), "--output_dir", str(out),
                    "--data_path", str(example / "data" / "alpaca_synthetic.json")],
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="session")
def _parity_world2_results(request):
    """Every selected 2-rank parity case of this run, trained in one gloo job (support/parity_world.py)."""
    from support.parity_world import groups_of, run_shared

    return run_shared(2, groups_of(request.session.items, "world2"))


@pytest.fixture(scope="module")
def world2(request, _parity_world2_results):
    """The results of this file's ``WORLD2_GROUPS`` on 2 ranks: group -> one entry per case -> one per rank.
    Every parity file shares the one job (support/parity_world.py)."""
    return _parity_world2_results[request.module.__name__]


def pytest_terminal_summary(terminalreporter) -> None:
    """With ``--durations``, the files that cost the run most (setup, call and teardown summed): where
    folding tests into fewer jobs pays. Then the vendor releases the conformance checks ran against."""
    if terminalreporter.config.getoption("durations", None) is not None:
        _slowest_files(terminalreporter)
    _vendor_releases(terminalreporter)


def _slowest_files(terminalreporter, shown: int = 15) -> None:
    seconds: dict[str, float] = {}
    tests: dict[str, set[str]] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            nodeid, duration = getattr(r, "nodeid", ""), getattr(r, "duration", None)
            if "::" in nodeid and duration is not None:
                path = nodeid.split("::", 1)[0]
                seconds[path] = seconds.get(path, 0.0) + duration
                tests.setdefault(path, set()).add(nodeid)
    if not seconds:
        return
    total = sum(seconds.values())
    terminalreporter.write_sep("=", f"slowest {min(shown, len(seconds))} files of {len(seconds)} ({total:.0f} s in all)")
    for path, spent in sorted(seconds.items(), key=lambda item: -item[1])[:shown]:
        terminalreporter.write_line(f"{spent:8.1f}s {100 * spent / total:5.1f}%  {len(tests[path]):4d} tests  {path}")


def _vendor_releases(terminalreporter) -> None:
    """Name the vendor releases the conformance checks ran against (tests/test_vendor_conformance.py;
    the support matrix in docs/backends.md records them)."""
    ran = [r for reports in terminalreporter.stats.values() for r in reports
           if getattr(r, "when", None) == "call" and "test_vendor_conformance" in getattr(r, "nodeid", "")]
    if not ran:
        return
    import importlib.metadata

    from support.vendor_sources import NPU_RELEASE, TPU_RELEASE, npu_wheel_path, tpu_wheel_path

    releases = []
    for dist in ("torch", "torch-xla"):
        try:
            releases.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    wheel = npu_wheel_path()
    releases.append(f"torch-npu {NPU_RELEASE} ({wheel.name})" if wheel else f"torch-npu {NPU_RELEASE}: wheel absent")
    wheel = tpu_wheel_path()
    releases.append(f"torch-tpu {TPU_RELEASE} ({wheel.name})" if wheel else f"torch-tpu {TPU_RELEASE}: wheel absent")
    terminalreporter.write_line("vendor conformance checked against: " + ", ".join(releases))
