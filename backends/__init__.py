"""The device layer: one Backend class per device family, and the choice among them.

Selection (``select``):
1. ``XSHARD_BACKEND`` in the environment (auto|cpu|cuda|npu|mps|tpu|xla, case-insensitive), and/or
   ``backend=`` in code. If both name a backend and they differ, that is an error naming both.
2. An explicitly named backend that cannot run here is an error naming what is missing and how to
   get it; it never silently falls back to another device.
3. ``auto`` probes in this order and takes the first that can run:
   tpu, xla, npu, cuda, mps, cpu.
   npu comes before cuda because torch_npu's ``transfer_to_npu`` patches ``torch.cuda`` to point at
   the NPU; tpu and xla come first because a TPU VM may also expose other devices, and tpu (TorchTPU)
   before xla (torch_xla) because TorchTPU is where Google's TPU documentation points PyTorch users.

Backends that live outside this package (see backends/README.md) are chosen by name only, never by
``auto``. They join the registry in one of two ways:

- ``register_backend("name", MyBackend)`` or ``register_backend("name", "my_pkg.module:MyBackend")``
  in the process that uses it (the script, before the Accelerator is built);
- an installed package's entry point in the group ``xshard.backends`` (``name = "my_pkg.module:MyBackend"``
  in its ``[project.entry-points."xshard.backends"]``), which every process finds by itself,
  `xshard launch` and `xshard env` included.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import (
    BackendConflictError,
    BackendUnavailableError,
    UnknownBackendError,
    VisibleDevicesError,
    WorldEnvironmentError,
    WorldSizeError,
    XShardError,
)
from .base import Backend, StepPatch, World
from .collectives import Collectives, CommCounter, DistCollectives, Handle, SingleProcessCollectives
from .device import PeakTable
from .devices.vendor import VendorImport, import_vendor
from .visible_devices import apply_visible_devices, parse_devices, visible_devices_value

ENV_VAR = "XSHARD_BACKEND"
#: the dry run's backend name (``backends/devices/dry_run_backend.py``; registered by ``python -m xshard.cli.dry_run``)
DRY_RUN = "dry_run"
log = logging.getLogger("xshard.backends")

#: the built-in backends: name -> "module:Class"; modules are imported only when probed or used
_BUILTIN: dict[str, str] = {
    "tpu": f"{__name__}.devices.tpu:TPUBackend",
    "xla": f"{__name__}.devices.xla:XLABackend",
    "npu": f"{__name__}.devices.npu:NPUBackend",
    "cuda": f"{__name__}.devices.cuda:CUDABackend",
    "mps": f"{__name__}.devices.mps:MPSBackend",
    "cpu": f"{__name__}.devices.cpu:CPUBackend",
}
#: the documented probe order of ``auto`` (backends registered from outside never take part)
AUTO_ORDER: tuple[str, ...] = ("tpu", "xla", "npu", "cuda", "mps", "cpu")
#: ``auto`` and the built-in backends (``names()`` adds the registered ones)
NAMES: tuple[str, ...] = ("auto", *_BUILTIN)
#: the entry-point group through which installed packages add backends
ENTRY_POINT_GROUP = "xshard.backends"

_registered: dict[str, type[Backend] | str] = {}
_entry_points_read = False
_lock = threading.Lock()
_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


def register_backend(name: str, backend: type[Backend] | str) -> None:
    """Add a backend that lives outside this package, selectable as ``XSHARD_BACKEND=<name>``.

    ``backend`` is a ``Backend`` subclass whose ``name`` is ``name``, or ``"module:Class"`` (imported
    when first used). Registering the same name again with the same target does nothing; another
    target, a built-in name or ``auto`` is an error.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if not isinstance(key, str) or not _NAME_PATTERN.fullmatch(key):
        raise UnknownBackendError(
            f"register_backend({name!r}): a backend name is lowercase letters, digits and '_', starting with a letter"
        )
    if key == "auto" or key in _BUILTIN:
        raise BackendConflictError(f"register_backend({name!r}): {key!r} is a built-in name; choose another name")
    if isinstance(backend, str):
        if ":" not in backend:
            raise UnknownBackendError(
                f"register_backend({name!r}, {backend!r}): give the class as 'module:Class', e.g. 'my_pkg.toy:ToyBackend'"
            )
    else:
        _check_class(key, backend, f"register_backend({name!r}, {getattr(backend, '__name__', backend)!r})")
    with _lock:
        known = _registered.get(key)
        if known is not None and known != backend:
            raise BackendConflictError(
                f"register_backend({name!r}): {key!r} is already registered as {_describe(known)}; "
                f"unregister_backend({key!r}) first to replace it"
            )
        _registered[key] = backend


def unregister_backend(name: str) -> None:
    """Remove a backend added with ``register_backend`` (no-op when it is not registered)."""
    with _lock:
        _registered.pop(name.strip().lower(), None)


def names() -> tuple[str, ...]:
    """Every valid value of ``XSHARD_BACKEND``: auto, the built-ins, then the registered backends."""
    _read_entry_points()
    return (*NAMES, *sorted(_registered))


def backend_class(name: str) -> type[Backend]:
    """The Backend class registered under ``name`` (a built-in or a registered backend)."""
    key = _normalise(name, source="backend name")
    if key == "auto":
        raise UnknownBackendError("'auto' is a selection mode, not a backend: use select() to resolve it")
    if key in _BUILTIN:
        return _load(_BUILTIN[key])
    target = _registered[key]
    if isinstance(target, str):
        cls = _load(target, registered_as=key)
        _check_class(key, cls, f"the backend {key!r} ({target})")
        return cls
    return target


def peak_tflops_table() -> PeakTable:
    """Every backend's ``peak_tflops`` in one table (the built-ins, then the registered ones): for a device
    named without its backend (``xshard estimate --machine``, a device name read elsewhere)."""
    _read_entry_points()
    table, seen = PeakTable({}), set()
    for name in (*_BUILTIN, *sorted(_registered)):
        try:
            own = backend_class(name).peak_tflops
        except XShardError:  # a registered backend that cannot be loaded has no figures to give
            continue
        if id(own) not in seen:
            seen.add(id(own))
            table = table + own
    return table


def _load(target: str, registered_as: str | None = None) -> type[Backend]:
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        if registered_as is None:
            raise
        raise BackendUnavailableError(
            f"the backend {registered_as!r} is registered as {target!r}, which cannot be loaded "
            f"({type(exc).__name__}: {exc}): install the package that provides it, or fix the registration"
        ) from exc


def _check_class(key: str, cls: object, where: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise UnknownBackendError(f"{where}: {cls!r} is not a subclass of xshard.backends.Backend")
    if cls.name != key:
        raise UnknownBackendError(
            f"{where}: the class's name attribute is {cls.name!r}; set name = {key!r} on the class "
            "(child processes select it by that name)"
        )


def _describe(target: type[Backend] | str) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _read_entry_points() -> None:
    """Register the backends that installed packages declare in the ``xshard.backends`` group (once)."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = entry.name.strip().lower()
        if key in _BUILTIN or key == "auto" or key in _registered:
            continue  # a built-in, or a registration made in code, wins
        try:
            register_backend(key, entry.value)
        except XShardError as exc:  # one bad plugin must not break selection of the others
            log.warning("ignoring the %s entry point %r: %s", ENTRY_POINT_GROUP, entry.name, exc)


def _normalise(value: str, source: str) -> str:
    key = value.strip().lower()
    if key == "":
        return "auto"
    if key in NAMES or key in _registered:
        return key
    valid = names()  # reads installed packages' entry points (once)
    if key not in valid:
        raise UnknownBackendError(
            f"{source}={value!r} is not a known backend; valid values are: {', '.join(valid)}"
        )
    return key


@dataclass(frozen=True)
class Selection:
    """Which backend was chosen, and why (for `xshard env` and the logs)."""

    cls: type[Backend]
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()  # (name, why not) for auto probes that missed

    @property
    def name(self) -> str:
        return self.cls.name


def select(backend: str | None = None, env: Mapping[str, str] | None = None) -> Selection:
    """Resolve the backend from ``backend=`` and ``XSHARD_BACKEND`` (see the module docstring)."""
    env = os.environ if env is None else env
    env_raw = env.get(ENV_VAR)
    from_env = _normalise(env_raw, ENV_VAR) if env_raw is not None else "auto"
    from_arg = _normalise(backend, "backend") if backend is not None else "auto"

    if from_env == DRY_RUN and from_arg != DRY_RUN:  # a dry run stands in for the backend the code or config names
        return _explicit(from_env, f"{ENV_VAR}={env_raw}" + (f", standing in for {from_arg}" if from_arg != "auto" else ""))
    if from_env != "auto" and from_arg != "auto" and from_env != from_arg:
        raise BackendConflictError(
            f"the code asks for backend={backend!r} but the environment has {ENV_VAR}={env_raw!r}: "
            f"remove one of them, or make them agree"
        )
    if from_env != "auto":
        return _explicit(from_env, f"{ENV_VAR}={env_raw}")
    if from_arg != "auto":
        return _explicit(from_arg, f"backend={backend!r} argument")
    return _auto()


def _explicit(name: str, source: str) -> Selection:
    cls = backend_class(name)
    why_not = probe(cls)
    if why_not is not None:
        raise BackendUnavailableError(f"{source} asks for the {name} backend, but it cannot run here: {why_not}")
    return Selection(cls, source)


def _auto() -> Selection:
    skipped: list[tuple[str, str]] = []
    for name in AUTO_ORDER:
        cls = backend_class(name)
        why_not = probe(cls) or cls.auto_skip_reason()
        if why_not is None:
            return Selection(cls, f"auto: first available in the order {', '.join(AUTO_ORDER)}", tuple(skipped))
        skipped.append((name, why_not))
    raise BackendUnavailableError("no backend can run here: " + "; ".join(f"{n}: {w}" for n, w in skipped))


def probe(cls: type[Backend]) -> str | None:
    """``cls.unavailable_reason()``, with a probe that crashes reported as a reason, not raised
    (one broken vendor install must not stop auto selection from reaching the next backend)."""
    try:
        return cls.unavailable_reason()
    except Exception as exc:
        return f"its availability probe failed: {type(exc).__name__}: {exc}"


def get_backend(backend: str | None = None, world: World | None = None) -> Backend:
    """Select and instantiate the backend for this process (does not start a process group)."""
    return select(backend).cls(world)


__all__ = [
    "AUTO_ORDER",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "NAMES",
    "Backend",
    "BackendConflictError",
    "BackendUnavailableError",
    "Collectives",
    "CommCounter",
    "DistCollectives",
    "Handle",
    "PeakTable",
    "Selection",
    "SingleProcessCollectives",
    "StepPatch",
    "UnknownBackendError",
    "VendorImport",
    "VisibleDevicesError",
    "World",
    "WorldEnvironmentError",
    "WorldSizeError",
    "XShardError",
    "apply_visible_devices",
    "backend_class",
    "get_backend",
    "import_vendor",
    "names",
    "parse_devices",
    "peak_tflops_table",
    "probe",
    "register_backend",
    "select",
    "unregister_backend",
    "visible_devices_value",
]
