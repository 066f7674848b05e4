"""Conformance of the tpu backend and the fake torch_tpu with TorchTPU: the torch-tpu 0.2.0 wheel, downloaded by
``make vendor-wheels`` into .cache/vendor-wheels and read with ``ast`` (torch_tpu cannot be imported without
libtpu), and this environment's torch for ``torch.accelerator``.

``torch.tpu`` is not a module of the wheel: ``torch_tpu._internal.public_api`` builds it from a table of
exports (``_PUBLIC_MODULES``: public name -> "module:Qualified.name"), which is read here to find each name's
definition. Beyond names and signatures, these check what TorchTPU does that a signature does not show: which
``torch.tpu`` functions it keeps internal (they raise RuntimeError when called from outside torch and torch_tpu,
so the device layer must not call them and the fake must refuse them), how it registers its process group,
its auto-loading entry point, the torch releases it supports, and that it ships no GradScaler.
"""

from __future__ import annotations

import ast
import inspect
import os
import typing
from collections.abc import Mapping

import pytest
import torch
from support.vendor_sources import TPU_RELEASE, WHEELS, Found, WheelSources, shape, tpu_wheel_path
from support.vendor_uses import Use
from test_vendor_conformance import MISSING, backend_uses, problems_against

PUBLIC_API = "torch_tpu._internal.public_api"
#: the torch releases the tpu backend runs on (torch-tpu 0.2.0's METADATA: torch>=2.11.0,<=2.15.0)
TORCH_RANGE = ((2, 11), (2, 15))

pytest_plugins = ("support.fakes.fixtures",)  # fixtures: make_fake_tpu
#: read once: tests that start from a clean environment drop every XSHARD_ variable
WHEELS_REQUIRED = os.environ.get("XSHARD_REQUIRE_VENDOR_WHEELS") == "1"


@pytest.fixture(scope="module")
def tpu_wheel() -> WheelSources:
    path = tpu_wheel_path()
    if path is None:
        why = (f"the torch-tpu {TPU_RELEASE} wheel is not in {WHEELS}: `make vendor-wheels` downloads it "
               "(`make test` does)")
        if WHEELS_REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    wheel = WheelSources(path)
    assert (wheel.name, wheel.version) == ("torch_tpu", TPU_RELEASE), path
    return wheel


@pytest.fixture(scope="module")
def exports(tpu_wheel) -> dict[str, dict[str, object]]:
    return public_exports(tpu_wheel)


def public_exports(wheel: WheelSources) -> dict[str, dict[str, object]]:
    """``torch.tpu`` and its submodules as the wheel declares them: {"torch.tpu": {name: "mod:Qual.name"
    or ("property", target)}}. Only the table's own assignments run (constants and one formatting function)."""
    tree = wheel.tree(PUBLIC_API)
    wanted = {"_DEVICE_MODULE", "_TPU_DEVICE_CLASS", "_DISTRIBUTED_MODULE", "_DISTRIBUTED_PROPERTIES_CLASS",
              "_tpu_attr", "_PUBLIC_MODULES"}
    picked = [node for node in tree.body
              if isinstance(node, ast.FunctionDef) and node.name in wanted
              or isinstance(node, (ast.Assign, ast.AnnAssign)) and _target_name(node) in wanted]
    namespace = {"Final": typing.Final, "Mapping": Mapping, "ModuleSpec": lambda **kw: kw.get("exports", {}),
                 "Property": lambda target: ("property", target)}
    exec(compile(ast.Module(body=picked, type_ignores=[]), PUBLIC_API, "exec"), namespace)  # noqa: S102
    return {module: dict(table) for module, table in namespace["_PUBLIC_MODULES"].items()}


def _target_name(node: ast.stmt) -> str | None:
    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
    return target.id if isinstance(target, ast.Name) else None


def resolve(wheel: WheelSources, exports: dict, name: str) -> Found | None:
    """The definition behind a public ``torch.tpu...`` name, or None when the wheel does not export it."""
    module, _, attr = name.rpartition(".")
    target = exports.get(module, {}).get(attr)
    if target is None:
        return None
    if isinstance(target, tuple):  # a property on the module's type
        target = target[1]
    path, _, qualname = target.partition(":")
    found = find(wheel, path, qualname)
    return found if found is not None else Found("value", path)  # e.g. an entry of __tt_api_stages__


def find(wheel: WheelSources, module: str, qualname: str) -> Found | None:
    """``module``'s ``qualname`` (``wheel.lookup`` walks from the top package, and torch_tpu._internal is a
    namespace package without an __init__.py)."""
    found: Found | None = Found("module", module)
    for part in qualname.split("."):
        found = wheel.member(found, part) if found.kind == "class" else wheel.lookup_from(found, part)
        if found is None:
            return None
    return found


def signature(wheel: WheelSources, found: Found) -> inspect.Signature | None:
    """``wheel.signature``, without ``cls`` for a classmethod (torch.tpu's functions are classmethods)."""
    sig = wheel.signature(found)
    if sig is not None and found.kind == "def" and any(
            isinstance(d, ast.Name) and d.id == "classmethod" for d in found.node.decorator_list):
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def internal_since(wheel: WheelSources) -> dict[str, tuple[int, int]]:
    """torch.tpu's functions that TorchTPU makes internal from a torch release on (they then raise when called
    from outside torch and torch_tpu): ``@internal_or_experimental(internal_when=get_torch_version() >= (2, N))``."""
    found = {}
    for cls in ("_DeviceModule", "TpuDeviceModule"):
        node = find(wheel, "torch_tpu._internal.device._device_module", cls).node
        for item in node.body:
            for deco in getattr(item, "decorator_list", []):
                if isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "internal_or_experimental":
                    when = next(k.value for k in deco.keywords if k.arg == "internal_when")
                    assert isinstance(when, ast.Compare) and isinstance(when.ops[0], ast.GtE), ast.unparse(when)
                    found[item.name] = tuple(ast.literal_eval(when.comparators[0]))
    return found


def tpu_problems(wheel: WheelSources, exports: dict, uses: list[Use]) -> list[str]:
    """The device layer's uses of torch.tpu that the wheel does not provide, or keeps internal on a torch the
    backend runs on."""
    tpu_uses = [u for u in uses if u.name.startswith(("torch.tpu.", "torch_tpu."))]

    def lookup(name: str):
        found = resolve(wheel, exports, name) if name.startswith("torch.tpu.") else find(wheel, *name.rsplit(".", 1))
        return MISSING if found is None else found

    problems = problems_against(tpu_uses, lookup, lambda found: signature(wheel, found))
    internal = internal_since(wheel)
    for use in tpu_uses:
        attr = use.name.removeprefix("torch.tpu.")
        if attr in internal and internal[attr] <= TORCH_RANGE[1]:
            problems.append(f"{use.name} is internal to TorchTPU on torch >= {'.'.join(map(str, internal[attr]))} "
                            f"and raises when xshard calls it (used at {use.where}); use torch.accelerator instead")
    return problems


# ---------------------------------------------------------------- what xshard calls


def test_the_scan_sees_the_tpu_backend_s_vendor_calls() -> None:
    uses = {u.name: u for u in backend_uses()}
    assert uses["torch.tpu.distributed.set_tpu_launch_env"].keywords == {"nnodes", "nproc_per_node"}
    assert {"torch.accelerator.device_count", "torch.accelerator.current_device_index", "torch.tpu.default_generators",
            "torch.accelerator.synchronize", "torch.accelerator.memory_allocated"} <= set(uses)


def test_torch_tpu_release_has_every_name_xshard_uses_and_none_it_keeps_internal(tpu_wheel, exports) -> None:
    problems = tpu_problems(tpu_wheel, exports, backend_uses())
    assert not problems, f"torch-tpu {tpu_wheel.version} ({tpu_wheel.path.name}):\n" + "\n".join(problems)


@pytest.mark.parametrize("extra,named", [
    (Use("torch.tpu.synchronize", frozenset(), "example.py:1", 0), "internal to TorchTPU on torch >= 2.11"),
    (Use("torch.tpu.get_rng_state", frozenset(), "example.py:1", 0), "internal to TorchTPU on torch >= 2.13"),
    (Use("torch.tpu.memory_allocated", frozenset(), "example.py:1", 0), "is missing"),
    (Use("torch.tpu.distributed.set_tpu_launch_env", frozenset({"nproc"}), "example.py:1", 0), "does not take"),
], ids=["internal", "internal-on-2.13", "missing", "keyword"])
def test_a_call_torch_tpu_would_refuse_fails_naming_it(tpu_wheel, exports, extra, named) -> None:
    # what the device layer would meet on a TPU had it kept torch.<device_type>'s defaults
    problems = tpu_problems(tpu_wheel, exports, [extra])
    assert problems and all(p.startswith(extra.name) and named in p for p in problems), problems


def test_torch_accelerator_has_every_name_and_keyword_the_tpu_backend_uses() -> None:
    from support.vendor_sources import live_signature
    from test_vendor_conformance import _live

    uses = [u for u in backend_uses() if u.name.startswith("torch.accelerator.")]
    assert uses
    problems = problems_against(uses, _live, live_signature)
    assert not problems, f"torch {torch.__version__}:\n" + "\n".join(problems)


def test_the_tpu_backend_s_facts_are_the_release_s(tpu_wheel) -> None:
    from xshard.backends import backend_class
    from xshard.backends.devices.tpu import LOAD_ENTRY_POINT
    from xshard.backends.devices.tpu import TORCH_RANGE as MESSAGE_RANGE

    TPU = backend_class("tpu")
    # torch's auto-loading calls this entry point; the probe calls the same one when auto-loading was off
    section = tpu_wheel.dist_info("entry_points.txt").split("[torch.backends]", 1)[1].split("[", 1)[0]
    assert [line.strip() for line in section.splitlines() if line.strip()] == [f"torch_tpu = {LOAD_ENTRY_POINT}"]
    load = find(tpu_wheel, *LOAD_ENTRY_POINT.split(":"))
    assert {"get_tpu_device_count", "_init_device"} <= tpu_wheel.calls_in(load)  # registers only where a TPU is
    requires = [line for line in tpu_wheel.dist_info("METADATA").splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires == ["Requires-Dist: torch>=2.11.0,<=2.15.0"]
    assert MESSAGE_RANGE == "{}.{} to {}.{}".format(*TORCH_RANGE[0], *TORCH_RANGE[1])
    # the process group: registered under the backend's dist_backend, with the plain (non-extended) constructor
    registered = _register_backend_calls(tpu_wheel)
    assert TPU.dist_backend in registered
    assert registered["tpu"] == registered["tpu_dist"] == {"devices": ["tpu"]}
    # ops compile per shape: the release describes a compilation cache for XLA computations, and makes
    # torch.compile static on a TPU; so the backend keeps batch shapes static (compiles_graphs)
    assert "Compilation cache for optimized execution of XLA computations" in tpu_wheel.dist_info("METADATA")
    assert 'kwargs["dynamic"] = False' in tpu_wheel.source("torch_tpu._loader") and TPU.compiles_graphs
    # no GradScaler anywhere in the release: the backend hands out none for fp16 (refused, bf16 named)
    assert not any("GradScaler" in tpu_wheel.source(m) for m in _modules(tpu_wheel))


def _register_backend_calls(wheel: WheelSources) -> dict[str, dict]:
    calls = {}
    for node in ast.walk(wheel.tree("torch_tpu._loader")):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_backend" and node.args
                and isinstance(node.args[0], ast.Constant)):
            calls[node.args[0].value] = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return calls


def _modules(wheel: WheelSources) -> list[str]:
    return [name[:-3].replace("/", ".").removesuffix(".__init__") for name in wheel._text if name.endswith(".py")]


def test_internal_device_functions_are_the_ones_with_an_accelerator_twin(tpu_wheel) -> None:
    internal = internal_since(tpu_wheel)
    assert {"device_count", "set_device", "synchronize", "current_device"} <= set(internal)
    assert internal["get_rng_state"] == (2, 13)  # hence the RNG state through default_generators
    strict = tpu_wheel.source("torch_tpu._internal.device._device_module")
    assert 'not env.get_bool_env_once(\n    "TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS"' in strict  # raising is the default


# ---------------------------------------------------------------- the fake torch_tpu


def test_fake_refuses_exactly_what_torch_tpu_keeps_internal(tpu_wheel) -> None:
    from support.fakes.tpu import INTERNAL_SINCE

    assert INTERNAL_SINCE == internal_since(tpu_wheel)


def test_fake_torch_tpu_offers_only_real_names_with_real_parameters(tpu_wheel, exports, make_fake_tpu) -> None:
    make_fake_tpu()
    problems = []
    for name, fake in vars(torch.tpu).items():
        if name.startswith("__") or inspect.ismodule(fake) and f"torch.tpu.{name}" in exports:
            continue  # a submodule torch_tpu declares: its members below
        real = resolve(tpu_wheel, exports, f"torch.tpu.{name}")
        if real is None:
            problems.append(f"torch.tpu.{name}: the fake has it, torch-tpu {tpu_wheel.version} has not")
        elif inspect.isfunction(fake):
            real_sig = signature(tpu_wheel, real)
            if real_sig is not None and shape(real_sig) != shape(inspect.signature(fake)):
                problems.append(f"torch.tpu.{name}: fake{inspect.signature(fake)} vs real{real_sig}")
    for name, fake in vars(torch.tpu.distributed).items():
        if name.startswith("__"):
            continue
        real = resolve(tpu_wheel, exports, f"torch.tpu.distributed.{name}")
        if real is None:
            problems.append(f"torch.tpu.distributed.{name}: the fake has it, torch-tpu has not")
        elif shape(signature(tpu_wheel, real)) != shape(inspect.signature(fake)):
            problems.append(f"torch.tpu.distributed.{name}: parameters differ")
    assert not problems, "\n".join(problems)


def test_fake_accelerator_answers_have_torch_s_parameters(make_fake_tpu) -> None:
    from support.fakes.tpu import PATCHED_ACCELERATOR, _saved_accelerator

    make_fake_tpu()
    for name in PATCHED_ACCELERATOR:
        fake, real = getattr(torch.accelerator, name), _saved_accelerator[name]
        assert fake is not real
        assert shape(inspect.signature(fake)) == shape(inspect.signature(real)), name


def test_fake_tpu_process_group_is_registered_as_torch_tpu_registers_it(tpu_wheel) -> None:
    from support.fakes.tpu import TPU_REGISTRATION, _tpu_over_gloo

    real = _register_backend_calls(tpu_wheel)["tpu"]
    assert "extended_api" not in real and "extended_api" not in TPU_REGISTRATION
    # c10d calls a plain constructor as (store, rank, size, timeout)
    assert [p.name for p in inspect.signature(_tpu_over_gloo).parameters.values()] == ["store", "rank", "size",
                                                                                       "timeout"]
    # deliberate: the fake chip's tensors are CPU tensors, so the fake "tpu" serves the CPU
    assert (real["devices"], TPU_REGISTRATION["devices"]) == (["tpu"], ["cpu"])


def test_fake_launch_env_keeps_what_torch_tpu_sets(tpu_wheel) -> None:
    # set_tpu_launch_env sets these through get_and_set_str_env_once, never overriding a value already set
    text = tpu_wheel.source("torch_tpu._internal.distributed.distributed")
    for variable in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID"):
        assert f'get_and_set_str_env_once(\n        "{variable}"' in text or f'"{variable}", ' in text, variable
    assert 'raise ValueError("set_tpu_launch_env(): expected TPU devices, got none")' in text
