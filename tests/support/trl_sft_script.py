"""A TRL ``SFTTrainer`` script on prompt-completion records, run with TRL's trainer or through xshard's mixin.

``SFT_TRAINER=stock`` trains with ``trl.SFTTrainer``; ``SFT_TRAINER=xshard`` with
``class XShardSFTTrainer(xshard.trainer.TrainerMixin, trl.SFTTrainer)``, TRL's own ``SFTConfig`` unchanged.
The main process writes the training log to ``<output_dir>/log_history.json``::

    python tests/support/trl_sft_script.py MODEL_DIR DATA_JSON OUTPUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import datasets
import torch
import transformers
import trl

from xshard.trainer import TrainerMixin


class XShardSFTTrainer(TrainerMixin, trl.SFTTrainer):
    """TRL's SFTTrainer on xshard."""


def main(model_dir: str, data_path: str, output_dir: str) -> None:
    with open(data_path) as f:
        records = json.load(f)[:40]
    rows = [{"prompt": f"{r['instruction']}\n{r['input']}\n", "completion": r["output"]} for r in records]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = trl.SFTConfig(output_dir=output_dir, max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3,
                         logging_steps=1, report_to="none", save_strategy="no", max_length=96, seed=5,
                         disable_tqdm=True, bf16=False)
    cls = XShardSFTTrainer if os.environ.get("SFT_TRAINER", "xshard") == "xshard" else trl.SFTTrainer
    trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
