"""TRL's GRPO, DPO and reward trainers on the tiny Qwen2, run with TRL's trainer or through xshard's mixin, each
with TRL's own config class unchanged.

``SFT_TRAINER=stock`` trains with TRL's class; ``SFT_TRAINER=xshard`` with ``class X(TrainerMixin, TRL's
class)``. For each kind the main process writes the training log to ``<output_dir>/<kind>/log_history.json``::

    python tests/support/trl_trainers_script.py KIND[,KIND...] MODEL_DIR DATA_JSON OUTPUT_DIR [--save_steps N] [--resume]

KIND is grpo, dpo or reward. Several kinds train one after the other in one job (one launch instead of one
per kind, as the suite runs them): each builds its own model, config and trainer (whose ``__init__`` seeds
the job), so it trains as it would in a process of its own.

4 steps each. GRPO: 4 prompts' groups of 4 completions (8 tokens at most), rewarded for a length near 20
characters. DPO and reward: preference pairs, the chosen answer a record's own output, the rejected one the
next record's; DPO's reference model is the frozen copy TRL makes; the reward model is a one-score
sequence-classification head.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import datasets
import torch
import transformers
import trl

from xshard.trainer import TrainerMixin


def reward_length(completions: list[str], **kwargs: object) -> list[float]:
    """Completions of about 20 characters are best."""
    return [-abs(20 - len(c)) / 20.0 for c in completions]


def _prompts(records: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"prompt": f"{r['instruction']}\n"} for r in records]


def _pairs(records: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"prompt": f"{r['instruction']}\n", "chosen": r["output"], "rejected": records[i + 1]["output"]}
            for i, r in enumerate(records[:-1])]


def _causal_lm(model_dir: str, tokenizer: Any) -> Any:  # noqa: ARG001  (one signature for both loaders)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _scorer(model_dir: str, tokenizer: Any) -> Any:
    torch.manual_seed(7)  # the score head is new: the same start in both trainers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1,
                                                                            dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


#: kind -> (TRL's trainer, its config, the rows, the model, the config's own settings, the trainer's arguments)
KINDS: dict[str, tuple[Any, Any, Any, Any, dict[str, Any], dict[str, Any]]] = {
    "grpo": (trl.GRPOTrainer, trl.GRPOConfig, _prompts, _causal_lm,
             {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8},
             {"reward_funcs": reward_length}),
    "dpo": (trl.DPOTrainer, trl.DPOConfig, _pairs, _causal_lm, {"per_device_train_batch_size": 2, "max_length": 64},
            {}),
    "reward": (trl.RewardTrainer, trl.RewardConfig, _pairs, _scorer,
               {"per_device_train_batch_size": 2, "max_length": 64}, {}),
}


def train(kind: str, opts: argparse.Namespace) -> None:
    """Train ``kind`` for 4 steps into ``<output_dir>/<kind>`` and write its log there."""
    stock, config_class, rows, load, settings, trainer_args = KINDS[kind]
    output_dir = os.path.join(opts.output_dir, kind)
    with open(opts.data_path) as f:
        records = json.load(f)[:33]
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model_dir)
    model = load(opts.model_dir, tokenizer)
    saving = {"save_strategy": "steps", "save_steps": opts.save_steps} if opts.save_steps else {"save_strategy": "no"}
    args = config_class(output_dir=output_dir, max_steps=4, learning_rate=1e-3, logging_steps=1,
                        report_to="none", seed=5, disable_tqdm=True, bf16=False, **settings, **saving)
    cls = type(f"XShard{stock.__name__}", (TrainerMixin, stock), {}) \
        if os.environ.get("SFT_TRAINER", "xshard") == "xshard" else stock
    trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows(records)),
                  processing_class=tokenizer, **trainer_args)
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    if trainer.is_world_process_zero():
        with open(os.path.join(output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kinds", help="one kind, or several separated by commas: " + ", ".join(sorted(KINDS)))
    parser.add_argument("model_dir")
    parser.add_argument("data_path")
    parser.add_argument("output_dir")
    parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in OUTPUT_DIR/KIND")
    opts = parser.parse_args()
    kinds = opts.kinds.split(",")
    if unknown := sorted(set(kinds) - set(KINDS)):
        parser.error(f"unknown kind(s) {', '.join(unknown)}: choose from {', '.join(sorted(KINDS))}")
    for kind in kinds:
        train(kind, opts)


if __name__ == "__main__":
    main()
