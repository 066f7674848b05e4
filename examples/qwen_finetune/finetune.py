"""The openMind guide's Qwen Alpaca fine-tune, as its users wrote it: a transformers Trainer script
(HfArgumentParser with model, data and training arguments, the Alpaca data module, ``Trainer``).

One line differs from the stock script, the import of ``Trainer`` and ``TrainingArguments``:

    from xshard.trainer import Trainer, TrainingArguments   # was: from transformers import ...

Run with the guide's arguments (see run_npu8.sh), on 8 NPUs, GPUs, a TPU VM or CPUs:

    torchrun --nproc_per_node=8 finetune.py --model_name_or_path /path/to/qwen1.5_7b_chat \\
        --data_path alpaca_data.json --deepspeed ds_config_zero3.json --bf16 True --output_dir ./test/output ...
    XSHARD_BACKEND=cpu xshard launch --nproc 2 finetune.py --deepspeed ds_config_zero3.json --output_dir out

With no ``--model_name_or_path`` it builds a tiny random Qwen2 and a Qwen-style tokenizer offline
(tiny.py); with no ``--data_path`` it reads the shipped synthetic Alpaca-format records.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the example's own modules, wherever it is run from

from data import SupervisedCollator, SupervisedDataset, check_vocab_fits, load_records, prepare_tokenizer  # noqa: E402
from tiny import DEFAULT_DATA, build_tiny_qwen  # noqa: E402

from xshard.trainer import Trainer, TrainingArguments  # noqa: E402  (was: from transformers import ...)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a local Hugging Face model folder (default: a tiny random Qwen2)"})


@dataclass
class DataArguments:
    data_path: str | None = field(
        default=None, metadata={"help": "Alpaca-format .json list or .jsonl (default: the shipped synthetic data)"})


@dataclass
class FinetuneArguments(TrainingArguments):
    cache_dir: str | None = field(default=None)
    optim: str = field(default="adamw_torch")
    model_max_length: int = field(
        default=512, metadata={"help": "Maximum sequence length. Sequences are right padded (and possibly truncated)."})


def make_supervised_data_module(tokenizer: Any, data_args: DataArguments, model_max_length: int) -> dict[str, Any]:
    """The Alpaca data module: the training set and its padding collator (no evaluation set)."""
    data_path = Path(data_args.data_path) if data_args.data_path else DEFAULT_DATA
    train_dataset = SupervisedDataset(load_records(data_path), tokenizer, model_max_length)
    return {"train_dataset": train_dataset, "eval_dataset": None,
            "data_collator": SupervisedCollator(tokenizer.pad_token_id)}


def load_model_and_tokenizer(model_args: ModelArguments, data_args: DataArguments,
                             training_args: FinetuneArguments) -> tuple[Any, Any]:
    """The model and tokenizer: from ``--model_name_or_path``, else the tiny offline Qwen2."""
    if model_args.model_name_or_path is None:
        model, tokenizer = build_tiny_qwen(Path(data_args.data_path) if data_args.data_path else DEFAULT_DATA)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, cache_dir=training_args.cache_dir)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            model_args.model_name_or_path, cache_dir=training_args.cache_dir,
            model_max_length=training_args.model_max_length, padding_side="right")
    model.config.use_cache = False
    # Qwen's tokenizer has a pad token (<|endoftext|>) and every id has an embedding row: nothing to add
    # or resize (resizing to len(tokenizer) would shrink Qwen's embedding; see data.py)
    prepare_tokenizer(tokenizer, training_args.model_max_length)
    check_vocab_fits(tokenizer, model)
    return model, tokenizer


def parse_arguments(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, FinetuneArguments]:
    """The command line (``sys.argv[1:]`` when ``argv`` is None) as the three argument dataclasses."""
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, FinetuneArguments))
    return parser.parse_args_into_dataclasses(argv)


def train(argv: list[str] | None = None) -> Trainer:
    """Fine-tune, save the trainer state and the model; returns the Trainer."""
    model_args, data_args, training_args = parse_arguments(argv)
    model, tokenizer = load_model_and_tokenizer(model_args, data_args, training_args)
    data_module = make_supervised_data_module(tokenizer, data_args, training_args.model_max_length)
    # transformers 5 names the tokenizer argument processing_class (transformers 4: tokenizer=)
    trainer = Trainer(model=model, processing_class=tokenizer, args=training_args, **data_module)
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if str(resume).lower() == "true" else resume)
    trainer.save_state()
    trainer.save_model(output_dir=training_args.output_dir)
    return trainer


if __name__ == "__main__":
    train()
