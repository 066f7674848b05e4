"""An ordinary Trainer SFT script, as its users write it (the openMind guide's ``finetune.py`` shape).

HfArgumentParser with model, data and training arguments, Alpaca prompts, a supervised dataset whose
prompt tokens are masked out of the loss, a padding collator, ``Trainer(...).train()``, ``save_state``
and ``save_model``. The only line that differs between the stock run and the xshard run is the import,
chosen here by ``SFT_TRAINER=stock|xshard`` (default xshard) so that the tests can run both::

    xshard launch --nproc 2 tests/support/trainer_sft_script.py --model_name_or_path tiny --data_path data.json \\
        --output_dir out --max_steps 8 --per_device_train_batch_size 2 --logging_steps 1

``--streaming true`` reads the training (and held-out) examples as an ``IterableDataset`` (with ``--max_steps``). ``--lora_r R`` trains a PEFT LoRA adapter instead of the whole model. ``--resume_from_checkpoint true`` resumes from the newest checkpoint in ``--output_dir``. With
``--eval_records N`` the last N records are held out: ``evaluate()`` and ``predict()`` run after training and
the main process writes their results to ``eval_results.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

IGNORE_INDEX = -100
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder"})
    lora_r: int = field(default=0, metadata={"help": "train a PEFT LoRA adapter of this rank on q_proj/v_proj (0: "
                                                     "the whole model)"})


@dataclass
class DataArguments:
    data_path: str = field(metadata={"help": "Alpaca-format JSON records"})
    max_records: int = field(default=0, metadata={"help": "use only the first N records (0: all)"})
    streaming: bool = field(default=False, metadata={"help": "read the training examples as a stream (an "
                                                                "IterableDataset; give --max_steps)"})
    eval_records: int = field(default=0, metadata={"help": "hold out the last N records for evaluation"})
    model_max_length: int = field(default=128, metadata={"help": "tokens per example at most"})


class Streamed(torch.utils.data.IterableDataset):
    """The examples of a dataset, one after the other (as a stream read from files gives them)."""

    def __init__(self, examples: torch.utils.data.Dataset) -> None:
        self.examples = examples

    def __iter__(self) -> Any:
        return (self.examples[i] for i in range(len(self.examples)))  # type: ignore[arg-type]


class SupervisedDataset(torch.utils.data.Dataset):
    """Prompt + response tokens; the prompt's labels are IGNORE_INDEX."""

    def __init__(self, records: Sequence[dict[str, str]], tokenizer: Any, max_length: int) -> None:
        self.examples = []
        for record in records:
            template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
            source = template.format_map(record)
            target = f"{record['output']}{tokenizer.eos_token}"
            source_ids = tokenizer(source, add_special_tokens=False)["input_ids"]
            ids = (source_ids + tokenizer(target, add_special_tokens=False)["input_ids"])[:max_length]
            labels = ([IGNORE_INDEX] * len(source_ids) + ids[len(source_ids):])[:max_length]
            self.examples.append({"input_ids": ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.examples[i]


@dataclass
class DataCollatorForSupervisedDataset:
    pad_token_id: int

    def __call__(self, instances: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(x["input_ids"]) for x in instances)
        ids = torch.full((len(instances), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(instances), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(instances), width), dtype=torch.long)
        for row, x in enumerate(instances):
            n = len(x["input_ids"])
            ids[row, :n] = torch.tensor(x["input_ids"])
            labels[row, :n] = torch.tensor(x["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def trainer_classes(impl: str) -> tuple[type, type]:
    """(Trainer, TrainingArguments) of the implementation asked for: the one line a user changes."""
    if impl == "xshard":
        from xshard.trainer import Trainer, TrainingArguments
    elif impl == "stock":
        from transformers import Trainer, TrainingArguments
    else:
        raise SystemExit(f"SFT_TRAINER={impl!r}: use stock or xshard")
    return Trainer, TrainingArguments


def main(argv: Sequence[str] | None = None, impl: str | None = None) -> Any:
    """Train; returns the Trainer (its ``state.log_history`` holds the losses)."""
    impl = impl or os.environ.get("SFT_TRAINER", "xshard")
    Trainer, TrainingArguments = trainer_classes(impl)
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
    if model_args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=model_args.lora_r, lora_alpha=2 * model_args.lora_r,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with open(data_args.data_path) as f:
        records = json.load(f)
    if data_args.max_records:
        records = records[: data_args.max_records]
    held_out = data_args.eval_records
    train_records = records[:-held_out] if held_out else records
    train: Any = SupervisedDataset(train_records, tokenizer, data_args.model_max_length)
    if data_args.streaming:
        train = Streamed(train)
    evaluation: Any = SupervisedDataset(records[-held_out:], tokenizer, data_args.model_max_length) if held_out else None
    if data_args.streaming and evaluation is not None:
        evaluation = Streamed(evaluation)

    trainer = Trainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=train,
                      eval_dataset=evaluation, data_collator=DataCollatorForSupervisedDataset(tokenizer.pad_token_id))
    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "false"):
        resume = resume.lower() == "true"
    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if evaluation is not None:
        metrics = trainer.evaluate()
        predictions = trainer.predict(evaluation)
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "eval_results.json"), "w") as f:
                json.dump({"eval_loss": metrics["eval_loss"], "predict_loss": predictions.metrics["test_loss"],
                           "predicted_rows": None if predictions.label_ids is None else len(predictions.label_ids)}, f)
    return trainer


if __name__ == "__main__":
    main()
