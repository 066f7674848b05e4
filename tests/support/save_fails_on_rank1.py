"""A job whose rank 1 cannot write its part of a checkpoint (an I/O error on its own RNG file).

``python save_fails_on_rank1.py OUT [sync|async]``: every other rank's part is written; rank 1's write raises,
as a failing disk under that rank's file would.
"""

from __future__ import annotations

import errno
import os
import sys

import torch

from xshard import Accelerator
from xshard.checkpoint import files

accelerator = Accelerator()
model = torch.nn.Linear(4, 4)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
if accelerator.process_index == 1:
    write = files.FileWriter._write

    def broken(self: files.FileWriter, name: str, body) -> None:  # type: ignore[no-untyped-def]
        if name.startswith("rng."):
            raise OSError(errno.EIO, "Input/output error", str(self.folder / name))
        write(self, name, body)

    files.FileWriter._write = broken  # type: ignore[method-assign]
accelerator.save_state(os.path.join(sys.argv[1], "checkpoint-1"), async_save=sys.argv[2] == "async")
accelerator.end_training()
