"""A torch_npu whose C extension cannot find CANN's shared libraries."""

import os

os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
