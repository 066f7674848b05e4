"""A TRL ``SFTTrainer`` script on prompt-completion records, run with TRL's trainer or through xshard's mixin.

``SFT_TRAINER=stock`` trains with ``trl.SFTTrainer``; ``SFT_TRAINER=xshard`` with
``class XShardSFTTrainer(xshard.trainer.TrainerMixin, trl.SFTTrainer)``, TRL's own ``SFTConfig`` unchanged.
The main process writes the training log to ``<output_dir>/log_history.json`` and what this run itself
logged and saved (``RunRecord``) to ``<output_dir>/this_run.json``::

    python tests/support/trl_sft_script.py MODEL_DIR DATA_JSON OUTPUT_DIR [options]

Without options: 4 steps, no checkpoints. The options a checkpointing run takes, as a user sets them:
``--max_steps N``, ``--save_steps N --save_total_limit N`` (checkpoints on), ``--stop_after_step N`` (a
callback ends training after step N, as an interrupted job that resumes later), ``--resume_from_checkpoint
PATH`` (``true``: the newest in OUTPUT_DIR) and ``--save_model`` (``trainer.save_model()`` at the end).
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


class XShardSFTTrainer(TrainerMixin, trl.SFTTrainer):
    """TRL's SFTTrainer on xshard."""


class StopAfterStep(transformers.TrainerCallback):
    """Ends training after step ``step`` (the checkpoint that step saves is written first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


class RunRecord(transformers.TrainerCallback):
    """What this run itself did, apart from the history a resumed run loads: the (step, loss) it logged
    and the steps it saved a checkpoint at."""

    def __init__(self) -> None:
        self.logged: list[list[float]] = []
        self.saved: list[int] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logged.append([state.global_step, logs["loss"]])

    def on_save(self, args, state, control, **kwargs):
        self.saved.append(state.global_step)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("data_path")
    parser.add_argument("output_dir")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints (save_strategy='no')")
    parser.add_argument("--save_total_limit", type=int, default=None)
    parser.add_argument("--stop_after_step", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--save_model", action="store_true")
    parser.add_argument("--lora_dropout", type=float, default=None,
                        help="train a PEFT LoRA adapter (r 4 on q_proj and v_proj) with this dropout, TRL's peft_config")
    opts = parser.parse_args(argv)

    with open(opts.data_path) as f:
        records = json.load(f)[:40]
    rows = [{"prompt": f"{r['instruction']}\n{r['input']}\n", "completion": r["output"]} for r in records]
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(opts.model_dir, dtype=torch.float32)
    saving = {"save_strategy": "steps", "save_steps": opts.save_steps, "save_total_limit": opts.save_total_limit} \
        if opts.save_steps else {"save_strategy": "no"}
    args = trl.SFTConfig(output_dir=opts.output_dir, max_steps=opts.max_steps, per_device_train_batch_size=4,
                         learning_rate=3e-3, logging_steps=1, report_to="none", max_length=96, seed=5,
                         disable_tqdm=True, bf16=False, **saving)
    cls = XShardSFTTrainer if os.environ.get("SFT_TRAINER", "xshard") == "xshard" else trl.SFTTrainer
    record = RunRecord()
    callbacks = [record, *([StopAfterStep(opts.stop_after_step)] if opts.stop_after_step else [])]
    lora = {}
    if opts.lora_dropout is not None:
        import peft

        lora["peft_config"] = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=opts.lora_dropout,
                                              target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                  **lora,
                  callbacks=callbacks)
    resume = opts.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "true" else resume)
    if opts.save_model:
        trainer.save_model()
    if trainer.is_world_process_zero():
        with open(os.path.join(opts.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        with open(os.path.join(opts.output_dir, "this_run.json"), "w") as f:
            json.dump({"logged": record.logged, "saved": record.saved}, f)


if __name__ == "__main__":
    main()
