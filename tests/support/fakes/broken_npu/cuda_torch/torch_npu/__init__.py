"""A torch_npu imported beside a CUDA build of torch."""

import os

os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
raise RuntimeError(
    "Two accelerators cannot be used at the same time in PyTorch: npu and cuda. You can install the cpu "
    "version of PyTorch to use your npu device, or use the cuda device with "
    "'export TORCH_DEVICE_BACKEND_AUTOLOAD=0'."
)
