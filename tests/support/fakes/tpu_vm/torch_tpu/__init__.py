"""torch_tpu as a TPU VM's processes import it, for tests that start processes (``xshard launch``): with this
folder on PYTHONPATH, ``import torch_tpu`` installs the fake of tests/support/fakes/tpu.py (``FAKE_TPU_CHIPS`` chips,
this process bound to chip ``LOCAL_RANK``) and names the device type "tpu", as the real one does."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # tests/, where the support package lives
from support.fakes.tpu import install_fake_torch_tpu  # noqa: E402

install_fake_torch_tpu(chips=int(os.environ.get("FAKE_TPU_CHIPS", "2")), index=int(os.environ.get("LOCAL_RANK", "0")),
                       name_device=True)
