"""A torch_npu that exits the interpreter on import, as some builds do when CANN is missing."""

import sys

sys.exit("fake torch_npu: CANN runtime not found, please source set_env.sh")
