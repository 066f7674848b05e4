"""CUDA backend: NVIDIA GPUs over NCCL.

bf16 means the GPU computes in it (compute capability 8.0, Ampere, and newer; any ROCm GPU):
``torch.cuda.is_bf16_supported()`` defaults to ``including_emulation=True`` (torch 2.9 and 2.13)
and then answers yes on V100 and T4 too, where bf16 is emulated. It answers for the current device
and starts CUDA, so it is asked once the process is bound to its own GPU (see ``bound_device``).
"""

from __future__ import annotations

import os
import sys

import torch

from ..base import Backend
from ..device import PeakTable
from .bound_device import ask_bound_device
from .vendor import torch_release

#: NVIDIA's and AMD's GPUs (ROCm builds of torch are torch.cuda too): dense figures (NVIDIA's sheets print bf16
#: with 2:4 sparsity, twice these). fp32 is the non-tensor-core figure: torch does not use TF32 for fp32 matmuls by
#: default.
GPU_PEAK_TFLOPS = PeakTable(
    {
        "A100": {"bf16": (312.0, "NVIDIA A100 datasheet"), "fp16": (312.0, "NVIDIA A100 datasheet"),
                 "fp32": (19.5, "NVIDIA A100 datasheet")},
        "H100 PCIe": {"bf16": (756.5, "NVIDIA H100 datasheet (PCIe, 1513 with sparsity)"),
                      "fp16": (756.5, "NVIDIA H100 datasheet (PCIe, 1513 with sparsity)"),
                      "fp32": (51.0, "NVIDIA H100 datasheet (PCIe)")},
        "H100": {"bf16": (989.4, "NVIDIA H100 datasheet (SXM, 1979 with sparsity)"),
                 "fp16": (989.4, "NVIDIA H100 datasheet (SXM, 1979 with sparsity)"),
                 "fp32": (67.0, "NVIDIA H100 datasheet (SXM)")},
        "H200": {"bf16": (989.4, "NVIDIA H200 datasheet (SXM, 1979 with sparsity)"),
                 "fp16": (989.4, "NVIDIA H200 datasheet (SXM, 1979 with sparsity)"),
                 "fp32": (67.0, "NVIDIA H200 datasheet (SXM)")},
        "B200": {"bf16": (2250.0, "NVIDIA HGX B200 specifications (per GPU, dense)"),
                 "fp16": (2250.0, "NVIDIA HGX B200 specifications (per GPU, dense)")},
        "MI300X": {"bf16": (1307.4, "AMD Instinct MI300X datasheet (dense)"),
                   "fp16": (1307.4, "AMD Instinct MI300X datasheet (dense)"),
                   "fp32": (163.4, "AMD Instinct MI300X datasheet")},
    },
    ((("h100", "pcie"), "H100 PCIe"), (("h100",), "H100"), (("h200",), "H200"), (("b200",), "B200"),
     (("a100",), "A100"), (("mi300x",), "MI300X")),
)


class CUDABackend(Backend):
    """NVIDIA GPUs: one process per GPU, NCCL process group, native AVG reductions."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    native_avg = True  # NCCL implements ReduceOp.AVG (since NCCL 2.10)
    pins_host_memory = True  # cudaHostAlloc: device-to-host copies run asynchronously
    peak_tflops = GPU_PEAK_TFLOPS
    install_hint = (
        "install a CUDA build of torch, e.g. pip install torch=={torch} "
        "--index-url https://download.pytorch.org/whl/cu126"
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # device_count() asks the driver (or NVML) without starting torch's CUDA context.
        if not torch.backends.cuda.is_built():
            return (
                f"this torch ({torch.__version__}) is built without CUDA: "
                + cls.install_hint.format(torch=torch_release())
            )
        if "torch_npu.contrib.transfer_to_npu" in sys.modules:
            # It rewires torch.cuda to the NPU: "cuda" here would really be the NPU without HCCL.
            return "torch_npu.contrib.transfer_to_npu is loaded and redirects torch.cuda to the NPU: use XSHARD_BACKEND=npu"
        if torch.cuda.device_count() == 0:
            visible = os.environ.get(cls.visible_devices_env or "")
            hidden = (
                f"; {cls.visible_devices_env}={visible!r} is set and may hide them" if visible is not None else ""
            )
            return (
                f"torch is built with CUDA {torch.version.cuda} but no CUDA device is visible{hidden}: "
                "check the GPU and its driver with nvidia-smi"
            )
        return None

    @classmethod
    def accelerate_distributed_type(cls) -> str:
        """Accelerate calls data parallel on GPUs MULTI_GPU."""
        return "MULTI_GPU"

    @classmethod
    def vendor_version(cls) -> str | None:
        return f"CUDA {torch.version.cuda}" if torch.version.cuda else None

    @classmethod
    def runtime_initialized(cls) -> bool:
        return bool(torch.cuda.is_initialized())

    def process_group_options(self) -> dict:
        # Binding the group to this process's GPU lets NCCL set up its communicator at once and
        # tells barrier() which GPU to use (otherwise torch guesses and warns).
        return {"device_id": self.device()}

    def supports(self, dtype: torch.dtype) -> bool:
        """fp32 and fp16 on every GPU; bf16 where the GPU computes in it, never emulated (see above)."""
        if dtype == torch.bfloat16:
            return bool(ask_bound_device(self, lambda: torch.cuda.is_bf16_supported(including_emulation=False)))
        return dtype in (torch.float32, torch.float16)

    def describe(self) -> dict:
        facts = super().describe()
        try:
            facts["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # a report must not crash on a half-working install
            facts["nccl_version"] = f"unknown ({type(exc).__name__})"
        return facts
