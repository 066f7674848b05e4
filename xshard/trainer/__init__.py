"""The transformers ``Trainer`` on xshard: ``from xshard.trainer import Trainer, TrainingArguments``.

- ``TrainingArguments`` / ``TrainingArgumentsMixin`` (``arguments``): transformers' arguments with the
  Trainer's meaning on xshard (``--deepspeed`` without DeepSpeed, ``--fsdp`` words, ``--bf16`` with the
  device check); other argument classes join with the mixin (``class C(TrainingArgumentsMixin, SFTConfig)``).
- ``sharding_config`` (``config``): any transformers ``TrainingArguments`` -> ``XShardConfig``.
- ``Trainer`` / ``TrainerMixin``: the Trainer's loop on xshard's Accelerator.
"""

from __future__ import annotations

from typing import Any

from ._requirements import transformers_trainer_error

try:
    from .arguments import TrainingArguments, TrainingArgumentsMixin
except ImportError as exc:  # transformers' own reason (accelerate missing...) in one line, with the fix
    raise transformers_trainer_error(exc) from exc
from .config import sharding_config

__all__ = ["Trainer", "TrainerMixin", "TrainingArguments", "TrainingArgumentsMixin", "sharding_config"]


def __getattr__(name: str) -> Any:
    # the Trainer imports transformers' Trainer (slow): loaded on first use
    if name in ("Trainer", "TrainerMixin"):
        try:
            from . import trainer
        except ImportError as exc:
            raise transformers_trainer_error(exc) from exc

        return getattr(trainer, name)
    raise AttributeError(f"module 'xshard.trainer' has no attribute {name!r}")
