"""Command-line arguments of finetune_loop.py (the own-loop version; finetune.py parses with the Trainer's
HfArgumentParser): the openMind/Hugging Face Trainer names, parsed into a dataclass.

The run command of the openMind Qwen guide works unchanged::

    torchrun --nproc_per_node=8 finetune_loop.py --model_name_or_path PyTorch-NPU/qwen1.5_7b_chat \\
        --data_path alpaca_data.json --deepspeed ds_config.json --bf16 True --output_dir ./test/output \\
        --max_steps 2000 --per_device_train_batch_size 1 --evaluation_strategy "no" --save_strategy "steps" \\
        --save_steps 3000 --save_total_limit 1 --learning_rate 1e-6 --weight_decay 0. --warmup_ratio 0.03 \\
        --lr_scheduler_type "cosine" --seed 1234 --logging_steps 1

Booleans follow the Trainer's convention: ``--bf16 True``, ``--bf16 false`` or a bare ``--bf16``.
The sharding setup comes from one file: ``--config`` (an xshard config, a DeepSpeed ds_config.json or
an Accelerate FSDP yaml), or its Trainer spellings ``--deepspeed FILE`` and ``--fsdp "full_shard
auto_wrap" [--fsdp_config FILE]``. Only one of them may be given.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TRUE_WORDS = ("true", "yes", "y", "t", "on", "1")
FALSE_WORDS = ("false", "no", "n", "f", "off", "0")
LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
SAVE_STRATEGIES = ("no", "steps", "epoch")
FSDP_WORDS = ("full_shard", "shard_grad_op", "no_shard", "offload", "auto_wrap")


@dataclass
class FinetuneArguments:
    """Everything finetune.py is told on its command line (Trainer names and defaults)."""

    output_dir: str
    model_name_or_path: str | None = None  # None: the tiny offline Qwen2 of tiny.py
    data_path: str | None = None  # None: the shipped synthetic Alpaca data
    config: str | None = None
    deepspeed: str | None = None
    fsdp: str = ""
    fsdp_config: str | None = None
    bf16: bool = False
    fp16: bool = False
    model_max_length: int = 512
    max_steps: int = -1
    num_train_epochs: float = 3.0
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    evaluation_strategy: str = "no"
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    lr_scheduler_type: str = "linear"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 42
    logging_steps: int = 500
    gradient_checkpointing: bool = False
    resume_from_checkpoint: str | None = None

    @property
    def mixed_precision(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"no"``, the xshard config spelling of --bf16/--fp16."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"

    @property
    def sharding_config_file(self) -> str | None:
        """The one file that configures sharding (--config, --deepspeed or --fsdp_config), or None."""
        return self.config or self.deepspeed or self.fsdp_config

    @property
    def fsdp_options(self) -> list[str]:
        """The words of --fsdp (``"full_shard auto_wrap"`` -> ``["full_shard", "auto_wrap"]``)."""
        return self.fsdp.split()


def str_to_bool(text: str) -> bool:
    """Trainer-style boolean: True/False, yes/no, 1/0, on/off (any case)."""
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _ratio(text: str) -> float:
    value = _non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def _max_steps(text: str) -> int:
    value = _int(text)
    if value == 0 or value < -1:
        raise argparse.ArgumentTypeError(f"must be a positive number of steps, or -1 for --num_train_epochs, got {text!r}")
    return value


def _choice(choices: Sequence[str]):
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text
    return parse


def _eval_strategy(text: str) -> str:
    if text != "no":
        raise argparse.ArgumentTypeError(f"{text!r}: this example trains only; use \"no\" (evaluation is not run)")
    return text


def _fsdp_words(text: str) -> str:
    unknown = [w for w in text.split() if w not in FSDP_WORDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown word(s) {', '.join(map(repr, unknown))}; "
                                         f"valid words: {' '.join(FSDP_WORDS)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser behind :func:`parse_args` (exposed for --help and tests)."""
    p = argparse.ArgumentParser(prog="finetune_loop.py", description="Alpaca supervised fine-tuning of a causal LM on xshard.")
    d = FinetuneArguments  # defaults

    def flag(name: str, default: bool, help_text: str) -> None:
        p.add_argument(name, type=str_to_bool, nargs="?", const=True, default=default, metavar="True|False",
                       help=help_text)

    p.add_argument("--model_name_or_path", help="local Hugging Face model folder (default: a tiny random Qwen2 "
                   "and a tokenizer built offline)")
    p.add_argument("--data_path", help="Alpaca-format .json list or .jsonl file (default: the shipped "
                   "data/alpaca_synthetic.json)")
    p.add_argument("--output_dir", required=True, help="where checkpoints and the final model go")
    p.add_argument("--config", help="xshard config, DeepSpeed ds_config.json or Accelerate FSDP yaml")
    p.add_argument("--deepspeed", help="DeepSpeed ds_config.json (same as --config)")
    p.add_argument("--fsdp", type=_fsdp_words, default=d.fsdp, help=f"Trainer FSDP words: {' '.join(FSDP_WORDS)}")
    p.add_argument("--fsdp_config", help="Trainer fsdp_config json/yaml, used with --fsdp")
    flag("--bf16", d.bf16, "bfloat16 mixed precision")
    flag("--fp16", d.fp16, "float16 mixed precision with loss scaling")
    flag("--gradient_checkpointing", d.gradient_checkpointing, "recompute activations in backward")
    p.add_argument("--model_max_length", type=_positive_int, default=d.model_max_length)
    p.add_argument("--max_steps", type=_max_steps, default=d.max_steps, help="optimizer steps; -1: use epochs")
    p.add_argument("--num_train_epochs", type=_non_negative_float, default=d.num_train_epochs)
    p.add_argument("--per_device_train_batch_size", type=_positive_int, default=d.per_device_train_batch_size)
    p.add_argument("--gradient_accumulation_steps", type=_positive_int, default=d.gradient_accumulation_steps)
    p.add_argument("--evaluation_strategy", "--eval_strategy", dest="evaluation_strategy", type=_eval_strategy,
                   default=d.evaluation_strategy)
    p.add_argument("--save_strategy", type=_choice(SAVE_STRATEGIES), default=d.save_strategy)
    p.add_argument("--save_steps", type=_positive_int, default=d.save_steps)
    p.add_argument("--save_total_limit", type=_positive_int, default=d.save_total_limit)
    p.add_argument("--learning_rate", type=_non_negative_float, default=d.learning_rate)
    p.add_argument("--weight_decay", type=_non_negative_float, default=d.weight_decay)
    p.add_argument("--warmup_ratio", type=_ratio, default=d.warmup_ratio)
    p.add_argument("--lr_scheduler_type", type=_choice(LR_SCHEDULERS), default=d.lr_scheduler_type)
    p.add_argument("--adam_beta1", type=_ratio, default=d.adam_beta1)
    p.add_argument("--adam_beta2", type=_ratio, default=d.adam_beta2)
    p.add_argument("--adam_epsilon", type=_non_negative_float, default=d.adam_epsilon)
    p.add_argument("--max_grad_norm", type=_non_negative_float, default=d.max_grad_norm, help="0 disables clipping")
    p.add_argument("--seed", type=_int, default=d.seed)
    p.add_argument("--logging_steps", type=_positive_int, default=d.logging_steps)
    p.add_argument("--resume_from_checkpoint", help="checkpoint folder to resume from, or True: the latest complete "
                   "checkpoint in --output_dir")
    return p


def _run_together_hint(argv: Sequence[str], option_names: Sequence[str]) -> str | None:
    """Spot a value with an option glued to it, e.g. ``"qwen1.5_7b_chat"\\`` then ``--data_path``.

    A line ending in ``"value"\\`` with no space before the backslash makes the shell join the next
    line's option onto the value (the openMind guide's command has this typo).
    """
    glued = re.compile(r".(--(?:" + "|".join(re.escape(n) for n in option_names) + r"))$")
    for token in argv:
        match = glued.search(token) if not token.startswith("--") else None
        if match:
            return (f"the argument {token!r} ends with the option {match.group(1)}: two arguments ran together. "
                    "In a shell script, put a space before each line-ending backslash.")
    return None


def parse_args(argv: Sequence[str] | None = None) -> FinetuneArguments:
    """Parse finetune.py's command line (``sys.argv[1:]`` when ``argv`` is None); exits with a message on error."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    option_names = [f.name for f in dataclasses.fields(FinetuneArguments)] + ["eval_strategy"]
    hint = _run_together_hint(argv, option_names)
    if hint:
        parser.error(hint)
    ns = parser.parse_args(argv)
    if ns.bf16 and ns.fp16:
        parser.error("--bf16 and --fp16 are both True; choose one")
    given = [f"--{n}" for n in ("config", "deepspeed", "fsdp") if getattr(ns, n)]
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} both configure sharding; give only one "
                     "(--config takes a DeepSpeed json or an FSDP yaml as well)")
    if ns.fsdp_config and not ns.fsdp:
        parser.error("--fsdp_config needs --fsdp (e.g. --fsdp \"full_shard auto_wrap\")")
    for name in ("config", "deepspeed", "fsdp_config"):
        path = getattr(ns, name)
        if path and not Path(path).is_file():
            parser.error(f"--{name} {path}: no such file")
    fields = {f.name for f in dataclasses.fields(FinetuneArguments)}
    return FinetuneArguments(**{k: v for k, v in vars(ns).items() if k in fields})
