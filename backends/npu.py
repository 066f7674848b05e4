"""NPU backend: Huawei Ascend NPUs through torch_npu, over HCCL.

``import torch_npu`` adds ``torch.npu`` and registers the "hccl" process-group backend. Facts that
shape this class:
- torch_npu must match torch exactly (torch-npu 2.5.1.postN for torch 2.5.1) and needs CANN's
  libraries on the library path (``source <CANN>/set_env.sh``); without them its import raises
  ImportError/OSError about libascendcl.so or libhccl.so, or exits the interpreter. torch >= 2.5
  auto-loads installed device extensions, so that failure can already happen in ``import torch``,
  before xshard runs; TORCH_DEVICE_BACKEND_AUTOLOAD=0 defers it to the guarded import here.
- HCCL has no ReduceOp.AVG: averages are a SUM then a divide (``native_avg = False``).
- ASCEND_RT_VISIBLE_DEVICES must list devices in ascending order.
- bf16 exists only on newer chips (Atlas A2 / 910B and later): ask ``torch.npu.is_bf16_supported()``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from .base import Backend, World
from .errors import BackendUnavailableError
from .vendor import import_vendor, torch_release

_CANN_HINT = (
    "set up CANN before starting Python (source <CANN install>/set_env.sh, e.g. "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh) and check that torch-npu matches torch ({torch})"
)


class NPUBackend(Backend):
    """Ascend NPUs: one process per NPU, HCCL process group, SUM-then-divide averages."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    native_avg = False
    vendor_module = "torch_npu"
    install_hint = "pip install torch-npu=={torch} (the release matching torch) and set up CANN (source set_env.sh)"
    related_env_vars = ("ASCEND_HOME_PATH", "ASCEND_OPP_PATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")

    def __init__(self, world: World | None = None) -> None:
        super().__init__(world)
        why_not = self.unavailable_reason()
        if why_not is not None:
            raise BackendUnavailableError(f"npu: {why_not}")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        imported = import_vendor("torch_npu")
        if imported.missing:
            return "torch_npu is not installed: " + cls.install_hint.format(torch=torch_release())
        if not imported.ok:
            return f"torch_npu is installed but cannot load ({imported.error}): " + _CANN_HINT.format(
                torch=torch_release()
            )
        npu = getattr(torch, "npu", None)
        if npu is None:
            return "torch_npu imported but torch.npu is missing: reinstall torch-npu matching torch " + torch_release()
        try:
            count = int(npu.device_count())
        except Exception as exc:  # the driver can fail here even when the import worked
            return f"torch.npu.device_count() failed ({type(exc).__name__}: {exc}): check the driver with npu-smi info"
        if count == 0:
            visible = os.environ.get(cls.visible_devices_env or "")
            hidden = f"; {cls.visible_devices_env}={visible!r} is set and may hide them" if visible is not None else ""
            return f"torch_npu loaded but no NPU is visible{hidden}: check the devices with npu-smi info"
        return None

    @classmethod
    def vendor_version(cls) -> str | None:
        module = sys.modules.get("torch_npu")
        return getattr(module, "__version__", None) if module is not None else None

    @classmethod
    def runtime_initialized(cls) -> bool:
        # Never imports torch_npu: if it is not imported, its runtime cannot have started.
        if sys.modules.get("torch_npu") is None:
            return False
        is_initialized = getattr(getattr(torch, "npu", None), "is_initialized", None)
        return bool(is_initialized()) if is_initialized is not None else False

    @classmethod
    def format_visible_devices(cls, ids: list[int]) -> str:
        return ",".join(str(i) for i in sorted(ids))  # HCCL requires ascending order

    def supports(self, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16:
            probe = getattr(self.device_module(), "is_bf16_supported", None)
            return bool(probe()) if probe is not None else False
        return dtype in (torch.float32, torch.float16)

    def grad_scaler(self, enabled: bool = True) -> Any:
        # torch_npu's own scaler knows the NPU's overflow-detection modes; torch.amp's generic one
        # works with torch_npu releases that register the "npu" amp kernels.
        amp = getattr(self.device_module(), "amp", None)
        scaler_cls = getattr(amp, "GradScaler", None)
        if scaler_cls is not None:
            return scaler_cls(enabled=enabled)
        return torch.amp.GradScaler(self.device_type, enabled=enabled)

