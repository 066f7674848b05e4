"""A user's Accelerate script for ``xshard launch --config ds_config.json``: "auto" values as Accelerate fills
them (accumulation from the Accelerator's argument, clipping 1.0, the micro batch from the prepared loader).

    xshard launch --nproc 2 --config ds_config.json launch_config_accelerate.py OUT

Rank 0 writes ``OUT/report.json``: the settings the job runs with (its config and the DeepSpeed plugin
``accelerator.state`` reports) and the optimizer steps taken.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from xshard import Accelerator

PER_RANK_BATCH, ACCUMULATION = 4, 2


def main(out: Path) -> None:
    acc = Accelerator(gradient_accumulation_steps=ACCUMULATION)  # the config: xshard launch --config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, x.sum(-1).sin()), batch_size=PER_RANK_BATCH)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for xb, yb in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(xb).squeeze(-1), yb))
            optimizer.step()
            optimizer.zero_grad()
    config, plugin = acc.config, acc.state.deepspeed_plugin
    if acc.is_main_process:
        report = {name: getattr(config, name) for name in (
            "stage", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
            "gradient_clipping", "mixed_precision")}
        report.update(distributed_type=acc.distributed_type.value, step=acc.step, world_size=acc.world_size,
                      plugin={"zero_stage": plugin.zero_stage, "gradient_clipping": plugin.gradient_clipping,
                              "gradient_accumulation_steps": plugin.gradient_accumulation_steps,
                              "train_micro_batch_size_per_gpu": plugin.deepspeed_config["train_micro_batch_size_per_gpu"]})
        (out / "report.json").write_text(json.dumps(report))
    acc.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
