"""A user's Trainer script for ``xshard launch --config ds_config.json``: the ds_config is the launcher's, not
``--deepspeed``, and its "auto" values come from the script's own arguments.

    xshard launch --nproc 2 --config ds_config_zero3.json launch_config_trainer.py --output_dir OUT \\
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --max_grad_norm 0.5 ...

HfArgumentParser over xshard's TrainingArguments, a small regression model, ``Trainer(...).train()``. Rank 0
writes ``OUT/report.json``: the settings the job runs with (``args.xshard_config``, by which the Trainer
accumulates and clips; the stage its Accelerator shards at) and the batch sizes of the micro-steps the model saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import HfArgumentParser

from xshard.trainer import Trainer, TrainingArguments


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen: list[int] = []  # the batch size of each forward in training

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.net(x).squeeze(-1)
        if self.training:
            self.seen.append(int(x.shape[0]))
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = [{"x": row, "labels": row.sum().sin()} for row in x]
    model = Regression()
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    config = args.xshard_config  # the job's config: the Trainer accumulates and clips by it itself
    if trainer.accelerator.is_main_process:
        report = {name: getattr(config, name) for name in (
            "stage", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
            "gradient_clipping", "mixed_precision", "optimizer")}
        report.update(global_step=trainer.state.global_step, seen=model.seen,
                      world_size=trainer.accelerator.world_size, sharded_at=trainer.accelerator.config.stage)
        Path(args.output_dir, "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
