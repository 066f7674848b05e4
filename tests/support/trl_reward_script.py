"""A TRL ``RewardTrainer`` script on preference pairs (a sequence-classification head on the tiny Qwen2, one
score), run with TRL's trainer or through xshard's mixin, TRL's own ``RewardConfig`` unchanged.

``SFT_TRAINER=stock`` trains with ``trl.RewardTrainer``; ``SFT_TRAINER=xshard`` with
``class XShardRewardTrainer(xshard.trainer.TrainerMixin, trl.RewardTrainer)``. The main process writes the
training log to ``<output_dir>/log_history.json``::

    python tests/support/trl_reward_script.py MODEL_DIR DATA_JSON OUTPUT_DIR [--save_steps N]

4 steps; the chosen answer of each record is its own output, the rejected one another record's.
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


class XShardRewardTrainer(TrainerMixin, trl.RewardTrainer):
    """TRL's RewardTrainer on xshard."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("data_path")
    parser.add_argument("output_dir")
    parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints")
    opts = parser.parse_args()

    with open(opts.data_path) as f:
        records = json.load(f)[:33]
    rows = [{"prompt": f"{r['instruction']}\n", "chosen": r["output"], "rejected": records[i + 1]["output"]}
            for i, r in enumerate(records[:-1])]
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model_dir)
    torch.manual_seed(7)  # the score head is new: the same start in both trainers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(opts.model_dir, num_labels=1,
                                                                            dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    saving = {"save_strategy": "steps", "save_steps": opts.save_steps} if opts.save_steps else {"save_strategy": "no"}
    args = trl.RewardConfig(output_dir=opts.output_dir, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, report_to="none", seed=5, disable_tqdm=True, bf16=False, max_length=64,
                         **saving)
    cls = XShardRewardTrainer if os.environ.get("SFT_TRAINER", "xshard") == "xshard" else trl.RewardTrainer
    trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(opts.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
