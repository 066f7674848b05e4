"""NPU backend: Huawei Ascend NPUs through torch_npu, over HCCL.

``import torch_npu`` adds ``torch.npu`` and registers the "hccl" process-group backend. Facts that
shape this class (read from torch_npu's sources, release 2.13.0 for torch 2.13):
- torch_npu must match torch (torch-npu 2.13.0 or 2.13.0.postN for torch 2.13.0) and needs CANN's
  libraries on the library path (``source <CANN>/set_env.sh``); without them its ``_C`` extension
  raises ImportError (``libhccl.so`` / ``libascendcl.so``), and with a CUDA build of torch it raises
  RuntimeError ("Two accelerators cannot be used at the same time"). torch >= 2.5 auto-loads
  installed device extensions, so that failure already happens inside ``import torch``, before
  xshard runs; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` defers it to the guarded import here.
- HCCL accepts ReduceOp.AVG: ProcessGroupHCCL runs an HCCL sum and divides by the group size on its
  own stream (all_reduce, reduce_scatter, _reduce_scatter_base, reduce), so ``native_avg = True``.
- ASCEND_RT_VISIBLE_DEVICES must list devices in ascending order (torch.npu.device_count() is 0
  otherwise).
- bf16 exists only on newer chips (Atlas A2 / 910B and later): ``torch.npu.is_bf16_supported()``
  answers for the current device and starts the runtime, so it is asked only once the process is
  bound to its own device (see ``bound_device``).
- fp16 loss scaling uses torch_npu's own GradScaler: on chips without inf/nan mode (910A class) it
  clears the global float-status flag in ``scale()``, which torch's generic scaler does not.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ...errors import BackendUnavailableError
from ..base import Backend, World
from ..device import PeakTable
from .bound_device import ask_bound_device
from .vendor import AUTOLOAD_ENV, import_vendor, torch_release

#: a pip requirement that matches torch-npu X.Y.Z and its X.Y.Z.postN rebuilds
_MATCHING_RELEASE = 'pip install "torch-npu=={torch}.*"'
_CANN_HINT = (
    "set up CANN before starting Python (source <CANN install>/set_env.sh, e.g. "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh) and install the torch-npu release matching torch {torch}: "
    + _MATCHING_RELEASE
)
_OTHER_ACCELERATOR_HINT = (
    "torch_npu needs the CPU build of torch {torch} beside it (pip install torch=={torch} --index-url "
    "https://download.pytorch.org/whl/cpu); to use this torch's own device instead, export "
    f"{AUTOLOAD_ENV}=0 so that import torch does not load torch_npu"
)


#: Huawei publishes no per-variant sheet for the 910B; the 910C is two such dies (CloudMatrix384 paper,
#: arXiv 2506.12708: 752 TFLOPS dense BF16/FP16 per 910C). 910B variants' clocks differ: set
#: XSHARD_PEAK_TFLOPS from a measured matmul for an exact MFU.
ASCEND_PEAK_TFLOPS = PeakTable(
    {
        "Ascend910C": {"bf16": (752.0, "CloudMatrix384 paper (arXiv 2506.12708): two dies"),
                       "fp16": (752.0, "CloudMatrix384 paper (arXiv 2506.12708): two dies")},
        "Ascend910B": {"bf16": (376.0, "one 910C die (CloudMatrix384 paper); variants differ"),
                       "fp16": (376.0, "one 910C die (CloudMatrix384 paper); variants differ")},
    },
    ((("910c",), "Ascend910C"), (("910_93",), "Ascend910C"), (("910b",), "Ascend910B")),
)


class NPUBackend(Backend):
    """Ascend NPUs: one process per NPU, HCCL process group (ReduceOp.AVG included)."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    native_avg = True  # ProcessGroupHCCL: AVG is an HCCL sum, then a divide on its stream
    pins_host_memory = True  # torch_npu pins host memory (aclrtMallocHost) for asynchronous copies
    peak_tflops = ASCEND_PEAK_TFLOPS
    vendor_module = "torch_npu"
    install_hint = _MATCHING_RELEASE + " (the release matching torch) and set up CANN (source set_env.sh)"
    related_env_vars = ("ASCEND_HOME_PATH", "ASCEND_OPP_PATH", AUTOLOAD_ENV)

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
            hint = _OTHER_ACCELERATOR_HINT if "Two accelerators" in (imported.error or "") else _CANN_HINT
            return f"torch_npu is installed but cannot load ({imported.error}): " + hint.format(torch=torch_release())
        if not hasattr(torch, "npu"):
            return "torch_npu imported but torch.npu is missing: reinstall torch-npu matching torch " + torch_release()
        try:
            count = int(torch.npu.device_count())
        except Exception as exc:  # the driver can fail here even when the import worked
            return f"torch.npu.device_count() failed ({type(exc).__name__}: {exc}): check the driver with npu-smi info"
        if count == 0:
            visible = os.environ.get(cls.visible_devices_env or "")
            hidden = f"; {cls.visible_devices_env}={visible!r} is set and may hide them" if visible is not None else ""
            if visible and not _ascending(visible):
                hidden += " (torch_npu sees no device at all unless the list is ascending, e.g. 0,2,4)"
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
        return bool(torch.npu.is_initialized())  # type: ignore[attr-defined]  # torch.npu: added by torch_npu

    @classmethod
    def format_visible_devices(cls, ids: list[int]) -> str:
        return ",".join(str(i) for i in sorted(ids))  # HCCL requires ascending order

    def supports(self, dtype: torch.dtype) -> bool:
        """fp32 and fp16 on every Ascend chip; bf16 where the chip says so (asked once bound, see above)."""
        if dtype == torch.bfloat16:
            return bool(ask_bound_device(self, self.device_module().is_bf16_supported))
        return dtype in (torch.float32, torch.float16)

    def grad_scaler(self, enabled: bool = True, **settings: Any) -> Any:
        """torch_npu's own ``torch.npu.amp.GradScaler`` (it knows the chip's overflow detection)."""
        return self.device_module().amp.GradScaler(enabled=enabled, **settings)


def _ascending(visible: str) -> bool:
    """Is a visible-devices list strictly ascending, as torch_npu requires ("0,2,4")?"""
    try:
        ids = [int(part) for part in visible.split(",")]
    except ValueError:
        return True  # not a plain list: torch_npu reads up to the first odd character; say nothing more
    return all(a < b for a, b in zip(ids, ids[1:], strict=False))
