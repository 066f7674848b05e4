"""The error each TrainingArguments setting that needs a package or the network gives, stock and xshard's.

Run with ``HF_ENDPOINT`` pointing at a closed local port (the Hub upload fails at once, and never reaches a
real Hub); prints one JSON object: setting -> [the stock Trainer's error, xshard's], each "Type: message".
"""

from __future__ import annotations

import json

import torch
import transformers

import xshard.trainer

CASES = {
    "use_liger_kernel": {"use_liger_kernel": True},
    "liger_kernel_config": {"use_liger_kernel": True, "liger_kernel_config": {"rope": True}},
    "optim_target_modules": {"optim": "galore_adamw", "optim_target_modules": ["linear"]},
    "push_to_hub": {"push_to_hub": True, "hub_model_id": "someone/parity"},
    "hub_token": {"push_to_hub": True, "hub_model_id": "someone/parity", "hub_token": "hf_not_a_token"},
}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.linear(x).sum()}


def _error(arguments: type, trainer: type, settings: dict, output_dir: str) -> str:
    try:
        args = arguments(output_dir=output_dir, report_to="none", use_cpu=True, max_steps=1, **settings)
        trainer(model=Tiny(), args=args, train_dataset=[{"x": torch.ones(2)}] * 4).train()
    except Exception as exc:  # the error is what is compared
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main() -> None:
    import sys

    out = sys.argv[1]
    results = {name: [_error(transformers.TrainingArguments, transformers.Trainer, settings, out),
                      _error(xshard.trainer.TrainingArguments, xshard.trainer.Trainer, settings, out)]
               for name, settings in CASES.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
