"""Train every family of ``support.model_zoo`` with the transformers Trainer, one after the other in one job.

Run on 2 processes, stock (``SFT_TRAINER=stock``, under torchrun on Accelerate's DDP) or on xshard
(``SFT_TRAINER=xshard``, under ``xshard launch``: stage 3)::

    xshard launch --nproc 2 tests/support/trainer_zoo_script.py OUT resnet,bert,llama

For each family: 3 optimizer steps (a global batch of 4, a checkpoint at step 2, the losses and gradient norms
logged every step), ``save_model``; then, on xshard, a second Trainer resumed from ``checkpoint-2``, and on
rank 0 the saved folder reloaded with ``from_pretrained`` and run on two rows. Rank 0 writes ``OUT/figures.json``
after each family: name -> {"model_class", "losses", "grad_norms", "reloaded", "missing_keys",
"resumed_losses"} or {"error": the exception}, so one family that cannot run names its reason and the others still run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from support.model_zoo import FAMILIES, Family

STEPS = 3


def _classes(impl: str) -> tuple[type, type]:
    if impl == "xshard":
        from xshard.trainer import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    return Trainer, TrainingArguments


def _train(impl: str, family: Family, out: Path, resume: Path | None = None) -> list[dict[str, Any]]:
    """The Trainer's log lines of one run (``resume``: from that checkpoint)."""
    trainer_class, arguments_class = _classes(impl)
    args = arguments_class(output_dir=str(out), per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1,
                           save_strategy="steps", save_steps=2, learning_rate=1e-2, lr_scheduler_type="constant",
                           max_grad_norm=1.0, report_to=[], seed=0, use_cpu=True, disable_tqdm=True)
    trainer = trainer_class(model=family.model, args=args, train_dataset=family.rows, data_collator=family.collate)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if resume is None:
        trainer.save_model(str(out / "model"))
    return [line for line in trainer.state.log_history if "loss" in line and "train_runtime" not in line]


def _reloaded(family: Family, folder: Path) -> tuple[list[float], list[str]]:
    """What the saved folder gives through ``from_pretrained``: its outputs on two rows and the missing keys."""
    model, info = type(family.model).from_pretrained(str(folder), output_loading_info=True)
    model.eval()
    with torch.no_grad():
        outputs = model(**family.collate(family.rows[:2]))
    first = next(v for k, v in outputs.items() if k != "loss" and isinstance(v, torch.Tensor))
    return [float(outputs.loss), *first.flatten()[:8].tolist()], sorted(info["missing_keys"])


def run_family(impl: str, name: str, out: Path) -> dict[str, Any]:
    """One family's figures (see the module docstring)."""
    family = FAMILIES[name]()
    figures: dict[str, Any] = {"model_class": type(family.model).__name__}
    lines = _train(impl, family, out)
    figures.update(losses=[line["loss"] for line in lines], grad_norms=[line["grad_norm"] for line in lines])
    if impl == "xshard":
        resumed = _train(impl, FAMILIES[name](), out, resume=out / "checkpoint-2")
        figures["resumed_losses"] = {line["step"]: line["loss"] for line in resumed}
    if int(os.environ.get("RANK", "0")) == 0:
        figures["reloaded"], figures["missing_keys"] = _reloaded(FAMILIES[name](), out / "model")
    return figures


def main(out: Path, names: list[str]) -> None:
    impl = os.environ.get("SFT_TRAINER", "xshard")
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run_family(impl, name, out / name)
        except Exception as exc:  # the family's reason, and the next family runs
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        if int(os.environ.get("RANK", "0")) == 0:
            (out / "figures.json").write_text(json.dumps(results, indent=1))
        print(f"zoo: {name} done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
