"""The transformers releases pyproject allows are the ones tested: the newest in .venv, the lowest in ``make
test-floor`` (``XSHARD_TRANSFORMERS_FLOOR``, also LLaMA-Factory's cap), where ``tests/test_trainer.py`` and
``tests/test_trainer_arguments.py`` run again.

On transformers 5.6 the stock ``TrainingArguments`` turns a missing ``--fsdp`` into ``[]`` and its Trainer takes
``len()`` of it: xshard's arguments once put ``None`` back and every Trainer crashed in ``__init__``.
"""

from __future__ import annotations

import os
import re

import torch
import transformers
from packaging.version import Version
from support.models import make_qwen2
from test_suite_hygiene import PYPROJECT


def _allowed_floor() -> Version:
    spec = next(r for r in PYPROJECT["project"]["optional-dependencies"]["hf"] if r.startswith("transformers"))
    found = re.search(r">=\s*([\d.]+)", spec)
    assert found, f"the hf extra names no lowest transformers: {spec}"
    return Version(found.group(1))


def test_the_transformers_under_test_is_the_one_claimed() -> None:
    installed = Version(transformers.__version__)
    floor = os.environ.get("XSHARD_TRANSFORMERS_FLOOR")
    if floor is not None:  # make test-floor: exactly the lowest release pyproject allows
        assert installed == Version(floor) == _allowed_floor()
    else:  # .venv: the newest, inside what pyproject allows
        assert installed >= _allowed_floor()


def test_a_trainer_without_fsdp_builds_and_trains(tmp_path) -> None:
    from xshard.trainer import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2,
                             per_device_train_batch_size=2, save_strategy="no", logging_steps=1, seed=0)
    rows = [{"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}] * 4
    trainer = Trainer(model=make_qwen2(), args=args, train_dataset=rows)
    trainer.train()
    losses = [line["loss"] for line in trainer.state.log_history if "loss" in line]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
