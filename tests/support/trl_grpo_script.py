"""A TRL ``GRPOTrainer`` script (generation in every step, a reward function), run with TRL's trainer or through
xshard's mixin, TRL's own ``GRPOConfig`` unchanged.

``SFT_TRAINER=stock`` trains with ``trl.GRPOTrainer``; ``SFT_TRAINER=xshard`` with
``class XShardGRPOTrainer(xshard.trainer.TrainerMixin, trl.GRPOTrainer)``. The main process writes the training
log to ``<output_dir>/log_history.json``::

    python tests/support/trl_grpo_script.py MODEL_DIR DATA_JSON OUTPUT_DIR [--save_steps N]

4 steps of 4 prompts' groups of 4 completions (8 tokens at most), rewarded for a length near 20 characters.
"""

from __future__ import annotations

import argparse
import json
import os

import datasets
import torch
import transformers
import trl

from xshard.trainer import TrainerMixin


class XShardGRPOTrainer(TrainerMixin, trl.GRPOTrainer):
    """TRL's GRPOTrainer on xshard."""


def reward_length(completions: list[str], **kwargs: object) -> list[float]:
    """Completions of about 20 characters are best."""
    return [-abs(20 - len(c)) / 20.0 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("data_path")
    parser.add_argument("output_dir")
    parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints")
    opts = parser.parse_args()

    with open(opts.data_path) as f:
        rows = [{"prompt": f"{r['instruction']}\n"} for r in json.load(f)[:32]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(opts.model_dir, dtype=torch.float32)
    saving = {"save_strategy": "steps", "save_steps": opts.save_steps} if opts.save_steps else {"save_strategy": "no"}
    args = trl.GRPOConfig(output_dir=opts.output_dir, max_steps=4, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to="none", seed=5,
                          disable_tqdm=True, bf16=False, **saving)
    cls = XShardGRPOTrainer if os.environ.get("SFT_TRAINER", "xshard") == "xshard" else trl.GRPOTrainer
    trainer = cls(model=model, args=args, reward_funcs=reward_length, train_dataset=datasets.Dataset.from_list(rows),
                  processing_class=tokenizer)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(opts.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
