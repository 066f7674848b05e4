"""Conformance: what xshard calls of each vendor package, and the fakes that stand in for them, checked
against the real releases xshard supports, without the hardware.

- torch-npu 2.13.0 (for torch 2.13): its wheel, downloaded by ``make vendor-wheels`` (``make test`` runs
  it) into .cache/vendor-wheels, read with ``ast`` (torch_npu cannot be imported without CANN).
- torch: this environment's (2.13 here; 2.9 in the XLA environment, where the tests marked ``xla`` run too).
  The CPU build has the same Python sources for ``torch.cuda`` and ``torch.mps`` as the GPU and Mac builds.
- torch_xla 2.9: the XLA environment's, imported (tests marked ``xla``).

Every vendor name the device layer reaches (tests/support/vendor_uses.py reads backends/ with ``ast``) must exist
in the release with a signature that accepts the call; a release that drops a name fails with that name.
Every fake offers only names of the module it stands for, with the same parameters, and keeps the side
effects xshard relies on; where a fake differs on purpose, the difference is named here.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
from pathlib import Path

import pytest
import torch
from support.vendor_sources import (
    NPU_RELEASE,
    WHEELS,
    WheelSources,
    accepts,
    live_lookup,
    live_signature,
    npu_wheel_path,
    shape,
)
from support.vendor_uses import Use, scan

ROOT = Path(__file__).resolve().parent.parent
BROKEN_NPU = Path(__file__).parent / "support" / "fakes" / "broken_npu"


@pytest.fixture(scope="module")
def npu_wheel() -> WheelSources:
    path = npu_wheel_path()
    if path is None:
        why = (f"the torch-npu {NPU_RELEASE} wheel is not in {WHEELS}: `make vendor-wheels` downloads it "
               "(`make test` does)")
        if os.environ.get("XSHARD_REQUIRE_VENDOR_WHEELS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    wheel = WheelSources(path)
    assert (wheel.name, wheel.version) == ("torch_npu", NPU_RELEASE), path
    return wheel


def backend_uses() -> list[Use]:
    from xshard.backends import backend_class

    return scan(ROOT / "backends", [backend_class(n) for n in ("cpu", "cuda", "npu", "mps", "xla", "tpu")])


MISSING = object()


def problems_against(uses: list[Use], lookup, signature) -> list[str]:
    """What does not hold of ``uses`` in a release: ``lookup(name)`` -> the object or MISSING, ``signature(obj)``."""
    problems = []
    for use in uses:
        found = lookup(use.name)
        if found is MISSING:
            problems.append(f"{use.name} is missing (used at {use.where})")
            continue
        if use.positional is None and not use.keywords:
            continue  # reached but not called here: its existence is the whole use
        sig = signature(found)
        if sig is None:
            continue  # a C function without a text signature: it exists, its parameters cannot be read
        if not accepts(sig, use.positional or 0, use.keywords):
            problems.append(f"{use.name}{sig} does not take {use.positional or 0} positional argument(s) and "
                            f"keywords {sorted(use.keywords)} (used at {use.where})")
    return problems


def npu_problems(wheel: WheelSources, uses: list[Use]) -> list[str]:
    """The uses of torch.npu / torch_npu that the wheel's sources do not provide."""
    def lookup(name: str):
        found = wheel.lookup("torch_npu.npu" + name[len("torch.npu"):] if name.startswith("torch.npu") else name)
        return MISSING if found is None else found

    return problems_against([u for u in uses if u.name.startswith(("torch.npu.", "torch_npu."))], lookup,
                            wheel.signature)


def _live(name: str):
    try:
        return live_lookup(name)
    except (ImportError, AttributeError):
        return MISSING


# ---------------------------------------------------------------- what xshard calls


def test_the_scan_sees_the_device_layer_s_vendor_calls() -> None:
    """The scanner itself: known uses, with their keywords and base-class uses per device module."""
    uses = {u.name: u for u in backend_uses()}
    assert uses["torch.npu.amp.GradScaler"].keywords == {"enabled"}
    assert uses["torch.cuda.is_bf16_supported"].keywords == {"including_emulation"}
    assert {"torch.cuda.set_device", "torch.npu.set_device"} <= set(uses)  # Backend.set_device serves both
    assert "torch.mps.set_device" not in uses  # MPSBackend overrides set_device
    assert {"groups", "pin_layout", "channel_id"} <= uses["torch_xla.core.xla_model.all_gather"].keywords


def test_torch_npu_release_has_every_name_and_keyword_xshard_uses(npu_wheel) -> None:
    problems = npu_problems(npu_wheel, backend_uses())
    assert not problems, f"torch-npu {npu_wheel.version} ({npu_wheel.path.name}):\n" + "\n".join(problems)


@pytest.mark.parametrize("file,old,new,named", [
    ("torch_npu/npu/utils.py", "def is_bf16_supported(", "def is_bf16_supported_v2(", "torch.npu.is_bf16_supported"),
    ("torch_npu/npu/amp/grad_scaler.py", "                 enabled=True):", "                 ):",
     "torch.npu.amp.GradScaler"),
], ids=["name-removed", "keyword-removed"])
def test_a_release_without_a_used_name_fails_naming_it(npu_wheel, file, old, new, named) -> None:
    text = npu_wheel.source(file[:-3].replace("/", ".").removesuffix(".__init__"))
    assert old in text
    changed = WheelSources(npu_wheel.path, replace={file: text.replace(old, new)})
    problems = npu_problems(changed, backend_uses())
    assert problems and all(p.startswith(named) for p in problems), problems


@pytest.mark.xla
def test_torch_has_every_name_and_keyword_xshard_uses() -> None:
    # torch.tpu and torch.accelerator serve the tpu backend, which needs torch >= 2.11 (checked against
    # the torch-tpu wheel and this environment's torch in tests/test_vendor_conformance_tpu.py)
    uses = [u for u in backend_uses() if u.name.startswith("torch.")
            and not u.name.startswith(("torch.npu", "torch.tpu", "torch.accelerator"))]
    problems = problems_against(uses, _live, live_signature)
    assert not problems, f"torch {torch.__version__}:\n" + "\n".join(problems)


@pytest.mark.xla
def test_torch_xla_has_every_name_and_keyword_xshard_uses() -> None:
    torch_xla = pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    problems = problems_against([u for u in backend_uses() if u.name.startswith("torch_xla")], _live, live_signature)
    assert not problems, f"torch_xla {torch_xla.__version__}:\n" + "\n".join(problems)


@pytest.mark.xla
def test_torch_xla_ships_no_grad_scaler_of_its_own() -> None:
    # XLABackend.grad_scaler() is torch.amp.GradScaler("xla") because of this; a release that adds
    # one should make it the backend's scaler
    amp = pytest.importorskip("torch_xla.amp", reason="needs torch_xla: make test-xla")
    version = pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla").__version__
    assert not hasattr(amp, "GradScaler"), f"torch_xla {version} has amp.GradScaler now: use it in XLABackend.grad_scaler"


# ---------------------------------------------------------------- the fake torch_npu


#: names the fake torch.npu has that torch_npu's has not, and why
FAKE_NPU_EXTRAS: dict[str, str] = {}
#: members of the fake GradScaler class that torch_npu's has not: the binding to the fake runtime
FAKE_SCALER_EXTRAS = {"_rt": "the fake runtime the scaler reads its chip mode from and records into"}
#: torch_npu functions that start the runtime in C++ (not visible in the Python sources)
STARTS_RUNTIME_IN_CPP = {"set_device": "THNPModule_setDevice_wrap calls npu_lazy_init before ExchangeDevice"}


@pytest.fixture
def fake_npu_module():
    from support.fakes.npu import NPUCalls, _npu_module

    return _npu_module(NPUCalls(), device_count=2, bf16=True, initialized=False, inf_nan_mode=False)


def _members(obj) -> dict[str, object]:
    return {n: v for n, v in vars(obj).items() if not (n.startswith("__") and n.endswith("__"))}


def test_fake_torch_npu_offers_only_real_names_with_real_parameters(npu_wheel, fake_npu_module) -> None:
    problems = []
    for name, fake in _members(fake_npu_module).items():
        real = npu_wheel.lookup(f"torch_npu.npu.{name}")
        if real is None:
            if name not in FAKE_NPU_EXTRAS:
                problems.append(f"torch.npu.{name}: the fake has it, torch-npu {npu_wheel.version} has not")
            continue
        if inspect.isfunction(fake) or inspect.isclass(fake):
            real_sig, fake_sig = npu_wheel.signature(real), inspect.signature(fake)
            if real_sig is not None and shape(real_sig) != shape(fake_sig):
                problems.append(f"torch.npu.{name}: fake{fake_sig} vs real{real_sig}")
        if isinstance(fake, type(os)):  # a submodule: its members in turn
            for sub, fake_fn in _members(fake).items():
                real_sub = npu_wheel.lookup(f"torch_npu.npu.{name}.{sub}")
                if real_sub is None:
                    problems.append(f"torch.npu.{name}.{sub}: the fake has it, torch-npu has not")
                elif inspect.isfunction(fake_fn) and shape(npu_wheel.signature(real_sub)) != shape(
                        inspect.signature(fake_fn)):
                    problems.append(f"torch.npu.{name}.{sub}: parameters differ")
    for cls_name in ("Stream", "Event"):
        real_cls = npu_wheel.lookup(f"torch_npu.npu.{cls_name}")
        extra = set(_members(getattr(fake_npu_module, cls_name))) - npu_wheel.class_names(real_cls)
        problems += [f"torch.npu.{cls_name}.{m}: the fake has it, torch-npu has not" for m in sorted(extra)]
    assert not problems, "\n".join(problems)


def test_fake_torch_npu_starts_the_runtime_where_the_real_one_does(npu_wheel, fake_npu_module) -> None:
    """Each fake function whose real version calls ``_lazy_init`` starts the fake runtime too."""
    starters = dict(STARTS_RUNTIME_IN_CPP)
    for name, fake in _members(fake_npu_module).items():
        real = npu_wheel.lookup(f"torch_npu.npu.{name}")
        if inspect.isfunction(fake) and real is not None and real.kind == "def" and name != "_lazy_init":
            if "_lazy_init" in npu_wheel.calls_in(real):
                starters[name] = "calls _lazy_init"
    assert {"is_bf16_supported", "current_device", "set_device"} <= set(starters)  # the ones xshard meets
    args = {"set_device": (1,)}
    from support.fakes.npu import NPUCalls, _npu_module

    for name in starters:
        if not hasattr(fake_npu_module, name):
            continue
        calls = NPUCalls()
        module = _npu_module(calls, device_count=2, bf16=True, initialized=False, inf_nan_mode=False)
        getattr(module, name)(*args.get(name, ()))
        assert module.is_initialized(), f"torch.npu.{name} ({starters[name]}) must start the fake runtime"
        assert calls.runtime_started_on == args.get(name, (0,))[0]


def test_fake_grad_scaler_is_shaped_like_torch_npu_s(npu_wheel, fake_npu_module) -> None:
    real = npu_wheel.lookup("torch_npu.npu.amp.GradScaler")
    fake = fake_npu_module.amp.GradScaler
    assert shape(inspect.signature(fake)) == shape(npu_wheel.signature(real))
    own = {n for c in fake.__mro__ if c.__module__.startswith("support.fakes") for n in _members(c)}
    assert own - npu_wheel.class_names(real) == set(FAKE_SCALER_EXTRAS)
    for name in own - set(FAKE_SCALER_EXTRAS):
        member = npu_wheel.member(real, name)
        if member is not None and member.kind == "def":
            assert shape(inspect.signature(getattr(fake, name))) == shape(npu_wheel.signature(member)), name

    # what the fake models of torch_npu's scaler (tests/support/fakes/npu.py) must still be true of the release
    def calls(method: str) -> set[str]:
        return npu_wheel.calls_in(npu_wheel.member(real, method))

    assert "super" not in calls("__init__")  # no torch.amp.GradScaler.__init__: no _device attribute
    assert {"is_support_inf_nan", "clear_npu_overflow_flag"} <= calls("scale")
    assert "_sync_dist_overflow_count" in calls("_unscale_grads_")
    assert {"is_support_inf_nan", "all_reduce"} <= calls("_sync_dist_overflow_count")
    assert "_npu_update_scale" in calls("update")
    reads = {n.attr for n in ast.walk(npu_wheel.member(real, "_npu_update_scale").node) if isinstance(n, ast.Attribute)}
    assert "_has_overflow" in reads and "_per_optimizer_states" not in reads  # update follows _has_overflow only


def _register_backend_call(wheel: WheelSources, name: str) -> dict:
    tree = wheel.tree("torch_npu._init.registry.distributed")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register_backend"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == name):
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    raise AssertionError(f"torch-npu {wheel.version} registers no {name!r} process-group backend")


def test_fake_hccl_is_registered_as_torch_npu_registers_it(npu_wheel) -> None:
    from support.fakes.npu import HCCL_REGISTRATION, _hccl_over_gloo

    real = _register_backend_call(npu_wheel, "hccl")
    assert real["extended_api"] is HCCL_REGISTRATION["extended_api"] is True
    assert [p.name for p in inspect.signature(_hccl_over_gloo).parameters.values()] == ["dist_backend_opts",
                                                                                        "pg_options"]
    # deliberate: the fake device's tensors are CPU tensors, so the fake "hccl" serves the CPU
    assert (real["devices"], HCCL_REGISTRATION["devices"]) == (["npu"], ["cpu"])


def test_broken_torch_npu_fakes_fail_as_the_release_does(npu_wheel) -> None:
    def entry_points(text: str) -> list[str]:
        section = text.split("[torch.backends]", 1)[1].split("[", 1)[0]
        return [line.strip() for line in section.splitlines() if line.strip()]

    real_entry = entry_points(npu_wheel.dist_info("entry_points.txt"))
    assert real_entry == ["torch_npu = torch_npu:_autoload"] and npu_wheel.lookup("torch_npu._autoload").kind == "def"
    init = npu_wheel.tree("torch_npu")
    order = [("autoload-off" if isinstance(n, ast.Assign) and "TORCH_DEVICE_BACKEND_AUTOLOAD" in ast.unparse(n)
              and ast.unparse(n.value) == "'0'" else "import torch" if isinstance(n, ast.Import)
              and any(a.name == "torch" for a in n.names) else None) for n in init.body]
    assert order.index("autoload-off") < order.index("import torch")  # switched off before anything else
    real_text = {"cuda_torch": npu_wheel.source("torch_npu"), "no_cann": npu_wheel.source("torch_npu._init.core.module_loader")}
    fragments = {"cuda_torch": "Two accelerators cannot be used at the same time", "no_cann": "libhccl.so"}
    for variant, fragment in fragments.items():
        fake_dir = BROKEN_NPU / variant
        dist_info = next(fake_dir.glob("torch_npu-*.dist-info"))
        assert entry_points((dist_info / "entry_points.txt").read_text()) == real_entry
        fake_source = (fake_dir / "torch_npu" / "__init__.py").read_text()
        assert fragment in real_text[variant] and fragment in fake_source
        assert 'os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"' in fake_source


# ---------------------------------------------------------------- fake torch.cuda and torch.mps


@pytest.mark.xla
def test_fake_cuda_has_torch_cuda_s_names_and_parameters(monkeypatch) -> None:
    from support.fakes.cuda import fake_cuda

    modules = {"torch.cuda": torch.cuda, "torch.backends.cuda": torch.backends.cuda}
    real = {f"{m}.{n}": getattr(mod, n) for m, mod in modules.items() for n in dir(mod)}
    fake_cuda(monkeypatch)
    patched = {f"{m}.{n}": getattr(mod, n) for m, mod in modules.items() for n in dir(mod)
               if f"{m}.{n}" in real and getattr(mod, n) is not real[f"{m}.{n}"] and callable(getattr(mod, n))}
    assert {"torch.cuda.is_bf16_supported", "torch.cuda.set_device", "torch.backends.cuda.is_built"} <= set(patched)
    for name, fake in patched.items():
        assert shape(inspect.signature(fake)) == shape(inspect.signature(real[name])), name


@pytest.mark.xla
def test_fake_mps_has_torch_s_names_and_parameters(monkeypatch) -> None:
    from support.fakes.mps import fake_mps

    mps = torch.backends.mps
    real = {n: getattr(mps, n) for n in dir(mps)}
    fake_mps(monkeypatch)
    patched = {n: getattr(mps, n) for n in dir(mps) if n in real and getattr(mps, n) is not real[n]}
    assert set(patched) == {"is_built", "is_available", "is_macos_or_newer"}
    for name, fake in patched.items():
        assert shape(inspect.signature(fake)) == shape(inspect.signature(inspect.unwrap(real[name]))), name


@pytest.mark.xla
def test_torch_autoload_failure_reads_as_the_cli_expects() -> None:
    from xshard.cli.torch_import import _AUTOLOAD_FAILED, AUTOLOAD_ENV

    source = inspect.getsource(torch._import_device_backends)
    template = re.search(r'f"(Failed to load the backend extension: \{backend_extension\.name\}\. )"', source)
    assert template and f"{AUTOLOAD_ENV}=0" in source, source
    message = template.group(1).replace("{backend_extension.name}", "torch_npu")
    assert _AUTOLOAD_FAILED.search(message).group(1) == "torch_npu"
