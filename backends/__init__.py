"""The device layer: one Backend class per device family, and the choice among them.

Selection (``select``):
1. ``XSHARD_BACKEND`` in the environment (auto|cpu|cuda|npu|mps|xla, case-insensitive), and/or
   ``backend=`` in code. If both name a backend and they differ, that is an error naming both.
2. An explicitly named backend that cannot run here is an error naming what is missing and how to
   get it; it never silently falls back to another device.
3. ``auto`` probes in this order and takes the first that can run:
   xla, npu, cuda, mps, cpu.
   npu comes before cuda because torch_npu's ``transfer_to_npu`` patches ``torch.cuda`` to point at
   the NPU; xla comes first because a TPU VM may also expose other devices.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from .base import Backend, World
from .collectives import Collectives, CommCounter, DistCollectives, Handle, SingleProcessCollectives
from .errors import (
    BackendConflictError,
    BackendUnavailableError,
    UnknownBackendError,
    VisibleDevicesError,
    WorldEnvironmentError,
    WorldSizeError,
    XShardError,
)
from .vendor import VendorImport, import_vendor
from .visible_devices import apply_visible_devices, parse_devices, visible_devices_value

ENV_VAR = "XSHARD_BACKEND"

#: name -> (module, class); modules are imported only when the backend is probed or used
_REGISTRY: dict[str, tuple[str, str]] = {
    "xla": ("xla", "XLABackend"),
    "npu": ("npu", "NPUBackend"),
    "cuda": ("cuda", "CUDABackend"),
    "mps": ("mps", "MPSBackend"),
    "cpu": ("cpu", "CPUBackend"),
}

#: the documented probe order of ``auto``
AUTO_ORDER: tuple[str, ...] = ("xla", "npu", "cuda", "mps", "cpu")
NAMES: tuple[str, ...] = ("auto", *_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    """The Backend class registered under ``name`` (one of cpu, cuda, npu, mps, xla)."""
    key = _normalise(name, source="backend name")
    if key == "auto":
        raise UnknownBackendError("'auto' is a selection mode, not a backend: use select() to resolve it")
    module, cls = _REGISTRY[key]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def _normalise(value: str, source: str) -> str:
    key = value.strip().lower()
    if key == "":
        return "auto"
    if key not in NAMES:
        raise UnknownBackendError(
            f"{source}={value!r} is not a known backend; valid values are: {', '.join(NAMES)}"
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


def select(backend: str | None = None, env: dict[str, str] | None = None) -> Selection:
    """Resolve the backend from ``backend=`` and ``XSHARD_BACKEND`` (see the module docstring)."""
    env = os.environ if env is None else env
    env_raw = env.get(ENV_VAR)
    from_env = _normalise(env_raw, ENV_VAR) if env_raw is not None else "auto"
    from_arg = _normalise(backend, "backend") if backend is not None else "auto"

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
    "ENV_VAR",
    "NAMES",
    "Backend",
    "BackendConflictError",
    "BackendUnavailableError",
    "Collectives",
    "CommCounter",
    "DistCollectives",
    "Handle",
    "Selection",
    "SingleProcessCollectives",
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
    "parse_devices",
    "probe",
    "select",
    "visible_devices_value",
]
