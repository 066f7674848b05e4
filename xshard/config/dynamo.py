"""Accelerate's ``dynamo_backend`` / ``dynamo_plugin``: how the Accelerator compiles each prepared model.

``read_dynamo_args(dynamo_backend, dynamo_plugin)`` reads the two constructor arguments as Accelerate's
``Accelerator`` reads them (both given: an error; neither: ``ACCELERATE_DYNAMO_*`` from the environment, which
``accelerate launch --dynamo_backend`` sets) into a ``TorchDynamoPlugin``: the fields, defaults, ``to_dict`` and
``to_kwargs`` of Accelerate's class of that name, which ``accelerator.state.dynamo_plugin`` reports. Accelerate's
own plugin object (or any object with its fields) is read by its fields; xshard never imports Accelerate.
``xshard.runtime.compile.compile_prepared`` applies it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from .values import parse_bool

__all__ = ["DynamoBackend", "TorchDynamoPlugin", "read_dynamo_args"]

_ENV = "ACCELERATE_DYNAMO_"


class DynamoBackend(str, Enum):
    """Accelerate's names of the torch.compile backends (``NO``: do not compile)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


def _backend(value: Any) -> DynamoBackend:
    name = str(getattr(value, "value", value)).upper()
    try:
        return DynamoBackend(name)
    except ValueError:
        raise ValueError(f"dynamo backend {value!r} is not one Accelerate knows: choose one of "
                         f"{', '.join(b.value.lower() for b in DynamoBackend)}") from None


def _env_flag(name: str, env: Mapping[str, str]) -> bool | None:
    value = env.get(_ENV + name)
    return None if value is None else parse_bool(_ENV + name, value)


@dataclass
class TorchDynamoPlugin:
    """The torch.compile settings of the prepared models: Accelerate's ``TorchDynamoPlugin`` (same fields,
    defaults and environment variables). ``backend`` ``NO`` compiles nothing."""

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        env = os.environ
        self.backend = _backend(self.backend if self.backend is not None else env.get(_ENV + "BACKEND", "no"))
        if self.mode is None:
            self.mode = env.get(_ENV + "MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = bool(_env_flag("USE_FULLGRAPH", env))
        if self.use_regional_compilation is None:
            self.use_regional_compilation = bool(_env_flag("USE_REGIONAL_COMPILATION", env))
        if self.dynamic is None:
            self.dynamic = _env_flag("USE_DYNAMIC", env)

    @property
    def enabled(self) -> bool:
        """Whether prepared models are compiled."""
        return self.backend is not DynamoBackend.NO

    def to_dict(self) -> dict[str, Any]:
        """The fields, the backend by its lower-case name (Accelerate's ``to_dict``)."""
        data = copy.deepcopy(self.__dict__)
        data["backend"] = self.backend.value.lower()
        return data

    def to_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` keywords: the fields that differ from a plugin built without any setting
        (Accelerate's ``to_kwargs``, which also leaves out ``use_regional_compilation``)."""
        defaults = {"backend": "no", "mode": "default", "fullgraph": False, "dynamic": None, "options": None,
                    "disable": False}
        return {k: v for k, v in self.to_dict().items() if k in defaults and v != defaults[k]}


def read_dynamo_args(dynamo_backend: Any = None, dynamo_plugin: Any = None) -> TorchDynamoPlugin:
    """The ``TorchDynamoPlugin`` of an Accelerator given these arguments (see the module docstring)."""
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise ValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one.")
    if dynamo_backend is not None:
        return TorchDynamoPlugin(backend=dynamo_backend)
    if dynamo_plugin is None:
        return TorchDynamoPlugin()
    if isinstance(dynamo_plugin, TorchDynamoPlugin):
        return dynamo_plugin
    given = {f.name: getattr(dynamo_plugin, f.name) for f in fields(TorchDynamoPlugin) if hasattr(dynamo_plugin, f.name)}
    if "backend" not in given:
        raise TypeError(f"dynamo_plugin={dynamo_plugin!r}: expected a TorchDynamoPlugin (accelerate.utils' or "
                        "xshard.config.dynamo's), with at least a backend")
    return TorchDynamoPlugin(**given)
