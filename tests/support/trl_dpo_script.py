"""A TRL ``DPOTrainer`` script on preference pairs (its reference model: a frozen copy TRL makes of the model),
run with TRL's trainer or through xshard's mixin, TRL's own ``DPOConfig`` unchanged.

``SFT_TRAINER=stock`` trains with ``trl.DPOTrainer``; ``SFT_TRAINER=xshard`` with
``class XShardDPOTrainer(xshard.trainer.TrainerMixin, trl.DPOTrainer)``. The main process writes the training
log to ``<output_dir>/log_history.json``::

    python tests/support/trl_dpo_script.py MODEL_DIR DATA_JSON OUTPUT_DIR [--save_steps N]

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


class XShardDPOTrainer(TrainerMixin, trl.DPOTrainer):
    """TRL's DPOTrainer on xshard."""


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
    model = transformers.AutoModelForCausalLM.from_pretrained(opts.model_dir, dtype=torch.float32)
    saving = {"save_strategy": "steps", "save_steps": opts.save_steps} if opts.save_steps else {"save_strategy": "no"}
    args = trl.DPOConfig(output_dir=opts.output_dir, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, report_to="none", seed=5, disable_tqdm=True, bf16=False, max_length=64,
                         **saving)
    cls = XShardDPOTrainer if os.environ.get("SFT_TRAINER", "xshard") == "xshard" else trl.DPOTrainer
    trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(opts.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
