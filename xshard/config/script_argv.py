"""The settings of a ds_config's ``"auto"`` values that ``xshard launch`` can read from its script's command line.

At launch time the script has not run: what its ``TrainingArguments`` (or an Accelerate script's
``Accelerator`` and data loaders) will say is unknown. What the command line spells out as the Trainer's
arguments (``--per_device_train_batch_size 4``, ``--gradient_accumulation_steps=2``, ``--max-grad-norm
0.5``, ``--bf16``) is read here; every other setting is ``LATER`` (``xshard.config.auto``): its ``"auto"``
keys are left for the script's process, where the Trainer fills them from its arguments and the
Accelerator as Accelerate does. A value that is not a number is ``LATER`` too: the script's own argument
parser reports it, with its own words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from xshard.config.auto import LATER

__all__ = ["launch_script_args"]


def _number(text: str) -> int | float:
    """``100`` -> 100, ``0.03`` -> 0.03 (``--warmup_steps`` below 1 is a ratio, as the Trainer reads it)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in ("true", "1", "yes", "y", "t"):
        return True
    if word in ("false", "0", "no", "n", "f"):
        return False
    raise ValueError(text)


#: the Trainer arguments an "auto" value comes from (``xshard.config.auto``), and how each is read
_READERS: dict[str, Callable[[str], Any]] = {
    "per_device_train_batch_size": int,
    "gradient_accumulation_steps": int,
    "max_grad_norm": float,
    "learning_rate": float,
    "adam_beta1": float,
    "adam_beta2": float,
    "adam_epsilon": float,
    "weight_decay": float,
    "max_steps": int,
    "warmup_steps": _number,
    "warmup_ratio": float,
    "bf16": _boolean,
    "fp16": _boolean,
}
_FLAGS = ("bf16", "fp16")  # given alone, as store_true options are: True
#: known only once the job runs (the launcher decides the processes after reading the config)
_RUN_TIME = ("num_training_steps", "world_size")


def _name(option: str) -> str | None:
    """The argument ``--per_device_train_batch_size`` or ``--per-device-train-batch-size`` names, if ours."""
    if not option.startswith("--"):
        return None
    name = option[2:].replace("-", "_")
    return name if name in _READERS else None


def launch_script_args(argv: Sequence[str]) -> dict[str, Any]:
    """``script_args`` for ``XShardConfig.load`` at launch time: the Trainer arguments ``argv`` gives in
    the usual spellings (``--name value``, ``--name=value``, dashes or underscores; the last one given
    wins, as argparse does), ``LATER`` for every other setting."""
    values: dict[str, Any] = {name: LATER for name in (*_READERS, *_RUN_TIME)}
    items = list(argv)
    for i, item in enumerate(items):
        option, has_value, text = item.partition("=")
        name = _name(option)
        if name is None:
            continue
        if not has_value:
            following = items[i + 1] if i + 1 < len(items) else None
            if name in _FLAGS and (following is None or following.startswith("--")):
                values[name] = True
                continue
            if following is None:
                values[name] = LATER
                continue
            text = following
        try:
            values[name] = _READERS[name](text)
        except (TypeError, ValueError, OverflowError):
            values[name] = LATER
    return values
