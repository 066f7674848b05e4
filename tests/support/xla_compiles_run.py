"""Run examples/qwen_finetune/finetune_loop.py in this process on one XLA:CPU device and print, as JSON,
torch_xla's compilation count after every optimizer step (the test reads the last line)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch_xla.debug.metrics as met

from xshard.backends.devices.xla import XLABackend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "qwen_finetune"))
import finetune_loop  # noqa: E402

counts: list[int] = []
_step = XLABackend.optimizer_step


def _counting_step(self: XLABackend, optimizer) -> None:
    _step(self, optimizer)
    data = met.metric_data("CompileTime")
    counts.append(int(data[0]) if data else 0)


XLABackend.optimizer_step = _counting_step
finetune_loop.main(sys.argv[1:])
print(json.dumps({"compiles": counts}))
