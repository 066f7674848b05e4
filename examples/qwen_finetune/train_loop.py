"""The pieces of finetune.py's training loop that are not xshard: optimizer groups, the LR schedule
and the step log (checkpoints, their rotation and resuming are xshard's ``save_state`` / ``load_state``).

- ``decay_groups``: AdamW parameter groups, no weight decay on norms and biases (as the Trainer).
- ``lr_lambda`` / ``make_scheduler``: linear, cosine, constant and constant-with-warmup schedules with
  a warmup ratio, written for ``torch.optim.lr_scheduler.LambdaLR``.
- ``StepLog``: loss, learning rate, tokens/s and memory every ``logging_steps`` optimizer steps.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

LOG_FILE = "train_log.jsonl"


# ---------------------------------------------------------------------------------------------- optimizer
def decay_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay for weight matrices, none for norms, biases and other vectors."""
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        lowered = name.lower()
        if name.endswith("bias") or "norm" in lowered or p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------------------------- schedule
def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Warmup steps for a ratio of the run (rounded up, as the Trainer does)."""
    return math.ceil(total_steps * warmup_ratio)


def lr_lambda(kind: str, total_steps: int, warmup: int):
    """The LR multiplier at optimizer step ``s`` (0-based) for schedule ``kind``."""

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup) if kind != "constant" else 1.0
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        if kind == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
        raise ValueError(f"lr_scheduler_type={kind!r}: use linear, cosine, constant or constant_with_warmup")

    return multiplier


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, total_steps: int, warmup_ratio: float):
    """A ``LambdaLR`` with warmup over ``warmup_ratio`` of ``total_steps``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(kind, total_steps,
                                                                   warmup_steps(total_steps, warmup_ratio)))


# ---------------------------------------------------------------------------------------------- checkpoints
# ---------------------------------------------------------------------------------------------- logging
def peak_host_memory_bytes() -> int:
    """This process's lifetime peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class StepLog:
    """Averages over the optimizer steps since the last log line; written on the main process only.

    Each record (also appended to ``<output_dir>/train_log.jsonl``) has ``step``, ``loss`` (mean over
    the steps, micro-batches and ranks), ``learning_rate``, ``tokens_per_s`` (all ranks, padding
    excluded), ``grad_norm`` when clipping, ``device_peak_mb`` and ``host_peak_mb``.
    """

    def __init__(self, output_dir: str | Path, is_main: bool, write: Any = print) -> None:
        self.path = Path(output_dir) / LOG_FILE
        self.is_main = is_main
        self.write = write
        self._reset()

    def _reset(self) -> None:
        self.loss_sum = 0.0
        self.micro_batches = 0
        self.tokens = 0
        self.started = time.perf_counter()

    def add_micro_batch(self, loss: float, tokens: int) -> None:
        """Record one micro-batch: its loss (already averaged over ranks) and tokens (summed over ranks)."""
        self.loss_sum += loss
        self.micro_batches += 1
        self.tokens += tokens

    def emit(self, step: int, total: int, learning_rate: float, extra: dict[str, Any]) -> dict[str, Any] | None:
        """Write one record for the steps since the last one; returns it (None on other ranks)."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        record = {"step": step, "loss": self.loss_sum / max(1, self.micro_batches), "learning_rate": learning_rate,
                  "tokens_per_s": self.tokens / elapsed, **extra,
                  "host_peak_mb": peak_host_memory_bytes() / 2**20}
        self._reset()
        if not self.is_main:
            return None
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        parts = [f"step {step}/{total}", f"loss {record['loss']:.4f}", f"lr {learning_rate:.3e}",
                 f"tokens/s {record['tokens_per_s']:.0f}"]
        if "grad_norm" in record:
            parts.append(f"grad_norm {record['grad_norm']:.3f}")
        parts.append(f"device peak {record.get('device_peak_mb', 0):.0f} MB")
        parts.append(f"host peak {record['host_peak_mb']:.0f} MB")
        self.write(" | ".join(parts))
        return record


def read_log(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records ``StepLog`` wrote (for tests and plots)."""
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
