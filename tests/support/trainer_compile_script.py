"""A small Trainer script for the tests of what the Trainer reports and compiles on xshard.

``TRAINER_IMPL=stock|xshard`` picks the import (transformers' Trainer or xshard's); the command line is the
``TrainingArguments``' (``HfArgumentParser``). A tiny model of three blocks (``_no_split_modules``: one unit
each at stage 3) trains on fixed data; each process writes ``rank<N>.json`` into ``--output_dir``: the
arguments' and the Trainer's process facts, the logged losses and torch dynamo's count of compiled graphs.
With ``--max_steps 0`` nothing trains (facts only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import transformers


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Tiny(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(3))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        return {"loss": torch.nn.functional.mse_loss(self.head(x).squeeze(-1), labels)}


def main() -> None:
    impl = os.environ.get("TRAINER_IMPL", "xshard")
    if impl == "xshard":
        from xshard.trainer import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    (args,) = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)
    model = Tiny()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 16, generator=generator), torch.randn(48, generator=generator)
    data = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    facts = {name: getattr(args, name) for name in ("n_gpu", "world_size", "process_index", "local_process_index",
                                                     "place_model_on_device", "train_batch_size")}
    facts.update(device=str(args.device), parallel_mode=str(args.parallel_mode),
                 trainer_place_model_on_device=trainer.place_model_on_device)
    if args.max_steps != 0:
        trainer.train()
    from torch._dynamo.utils import counters

    record = {"facts": facts, "graphs": counters["stats"]["unique_graphs"],
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / f"rank{args.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
