"""A fine-tuning framework's SFT entry, in the shape LLaMA-Factory's has, for running unedited on xshard.

The framework defines its own arguments class (``FinetuningArguments(Seq2SeqTrainingArguments)`` with fields
of its own) and its own Trainer subclass (``CustomSeq2SeqTrainer(Seq2SeqTrainer)``, which takes the
framework's arguments and overrides ``compute_loss``), parses a yaml file as its users write it with
``HfArgumentParser``, and never imports xshard. Its launcher module (``support.framework_launcher``) runs it::

    python -m support.framework_launcher config.yaml

The yaml uses transformers 4's ``warmup_ratio`` as LLaMA-Factory's examples do. Records are ``{"text": ...}``
lines (``dataset``: a .jsonl file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)


@dataclass
class ModelArguments:
    """Which model to fine-tune."""

    model_name_or_path: str = field(metadata={"help": "a from_pretrained folder"})


@dataclass
class DataArguments:
    """Which records, cut to how many tokens."""

    dataset: str = field(metadata={"help": "a .jsonl file of {'text': ...} records"})
    cutoff_len: int = 64


@dataclass
class FinetuningArguments(Seq2SeqTrainingArguments):
    """The framework's training arguments: transformers' with fields of its own."""

    stage: str = field(default="sft", metadata={"help": "the training stage"})
    plot_loss: bool = False


class CustomSeq2SeqTrainer(Seq2SeqTrainer):
    """The framework's Trainer: it keeps its own arguments and counts the losses it computed."""

    def __init__(self, finetuning_args: FinetuningArguments, **kwargs) -> None:
        super().__init__(**kwargs)
        self.finetuning_args = finetuning_args
        self.losses_computed = 0

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        self.losses_computed += 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)


def run_exp(config_path: str) -> None:
    """Train as the yaml says; resume where it names a checkpoint; save the model at the end."""
    parser = HfArgumentParser((ModelArguments, DataArguments, FinetuningArguments))
    model_args, data_args, training_args = parser.parse_yaml_file(config_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
    with open(data_args.dataset) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    records = [tokenizer(t, truncation=True, max_length=data_args.cutoff_len) for t in texts]
    trainer = CustomSeq2SeqTrainer(
        finetuning_args=training_args, model=model, args=training_args, train_dataset=records,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"framework: {type(trainer).__name__} computed {trainer.losses_computed} losses", flush=True)
