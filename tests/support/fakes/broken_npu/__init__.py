"""Installed torch_npu packages that fail to import the ways the real one does.

Each folder holds a package and its ``dist-info`` with torch_npu's entry point in the
"torch.backends" group, so that, as with the real package, ``import torch`` auto-loads it (unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0). Put a folder first on sys.path (or PYTHONPATH) to install it:

- ``no_cann``: CANN's libraries are missing (not installed, or set_env.sh not sourced): the ``_C``
  extension raises ImportError naming libhccl.so.
- ``cuda_torch``: torch is a CUDA build: torch_npu refuses with RuntimeError ("Two accelerators ...").

Both first switch TORCH_DEVICE_BACKEND_AUTOLOAD to "0", as torch_npu does before it imports
anything (it restores the user's value only at the end of a successful import). The messages are
torch_npu 2.13.0's (tests/test_vendor_conformance.py checks them against its wheel).
"""
