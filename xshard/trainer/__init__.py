"""The transformers ``Trainer`` on xshard: ``from xshard.trainer import Trainer, TrainingArguments``.

- ``TrainingArguments`` / ``TrainingArgumentsMixin`` (``arguments``): transformers' arguments with the
  Trainer's meaning on xshard (``--deepspeed`` without DeepSpeed, ``--fsdp`` words, ``--bf16`` with the
  device check); other argument classes join with the mixin (``class C(TrainingArgumentsMixin, SFTConfig)``).
- ``sharding_config`` (``config``): any transformers ``TrainingArguments`` -> ``XShardConfig``.
- ``Trainer`` / ``TrainerMixin``: the Trainer's loop on xshard's Accelerator; ``Seq2SeqTrainer`` and
  ``Seq2SeqTrainingArguments``: transformers' seq2seq pair the same way. Any other Trainer subclass joins
  with the mixins (``class MySFT(TrainerMixin, trl.SFTTrainer)``); asking this module for one is an
  ImportError that says so.
"""

from __future__ import annotations

from typing import Any

from ._requirements import transformers_trainer_error

try:
    from .arguments import Seq2SeqTrainingArguments, TrainingArguments, TrainingArgumentsMixin
except ImportError as exc:  # transformers' own reason (accelerate missing...) in one line, with the fix
    raise transformers_trainer_error(exc) from exc
from .config import sharding_config

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments", "Trainer", "TrainerMixin", "TrainingArguments",
           "TrainingArgumentsMixin", "sharding_config"]


def __getattr__(name: str) -> Any:
    # the Trainer imports transformers' Trainer (slow): loaded on first use
    if name in ("Trainer", "TrainerMixin", "Seq2SeqTrainer"):
        try:
            from . import trainer
        except ImportError as exc:
            raise transformers_trainer_error(exc) from exc

        return getattr(trainer, name)
    # ``from xshard.trainer import SFTTrainer``: Python would say only "cannot import name"
    if name.endswith("Trainer"):
        raise ImportError(f"xshard.trainer has no {name}: it ships Trainer and Seq2SeqTrainer; any other Trainer "
                          f"subclass runs on xshard through the mixin: class My{name}(xshard.trainer.TrainerMixin, "
                          f"{name}) (its module's own class, the mixin first)", name=name)
    if name.endswith(("Arguments", "Config")) and not name.startswith("_"):
        raise ImportError(f"xshard.trainer has no {name}: it ships TrainingArguments and Seq2SeqTrainingArguments; "
                          f"any other arguments class joins through the mixin: @dataclass class My{name}("
                          f"xshard.trainer.TrainingArgumentsMixin, {name})", name=name)
    raise AttributeError(f"module 'xshard.trainer' has no attribute {name!r}")
