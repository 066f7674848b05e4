"""The fix that fits a program that ran without xshard (for ``xshard launch``'s closing line).

``program_fix(script, module, switch)`` reads the program's source (never runs it) and names the change
that fits how it is written:

- it imports ``Trainer`` / ``TrainingArguments`` (or ``Seq2SeqTrainer``) from transformers: the import;
- it defines a subclass of a Trainer (its own, TRL's...): ``xshard.trainer.TrainerMixin`` first in the bases;
- it builds a Trainer it imports from another package (TRL's ``SFTTrainer``), or it is a module or a
  command (``-m trl.scripts.sft``, a framework's entry): the switch, ``xshard launch --trainer``, with no edit;
- it imports Accelerate's ``Accelerator``: ``from xshard import Accelerator``.
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["program_fix"]

SWITCH = "rerun with `xshard launch --trainer ...` (every transformers Trainer in the job on xshard, no edit)"
_ACCELERATOR = "change its import to `from xshard import Accelerator`"
_GENERIC = (f"for an Accelerate program, {_ACCELERATOR}; for a transformers Trainer program (TRL, LLaMA-Factory, "
            f"a script of your own), {SWITCH}")
_HF_NAMES = {"Trainer", "TrainingArguments", "Seq2SeqTrainer", "Seq2SeqTrainingArguments"}


def program_fix(script: str, module: bool, switch: bool = False) -> str:
    """The fix to name for a program that built no xshard Accelerator (see the module docstring)."""
    if switch:
        return ("--trainer was on, yet no transformers Trainer was built in the job's processes: the program uses "
                f"none (for an Accelerate program, {_ACCELERATOR}), or it started a launcher of its own (give "
                "xshard launch the script that launcher runs)")
    found = None if module else _read(script)
    if found is None:
        return _GENERIC
    hf_names, subclasses, other_trainers, accelerator = found
    fixes = []
    if subclasses:
        names = ", ".join(subclasses)
        fixes.append(f"put `xshard.trainer.TrainerMixin` first in the bases of {names} "
                     f"(`class {subclasses[0]}(TrainerMixin, ...)`), or {SWITCH}")
    elif hf_names:
        fixes.append(f"change its import to `from xshard.trainer import {', '.join(sorted(hf_names))}`")
    elif other_trainers:
        fixes.append(f"it builds {', '.join(other_trainers)}: {SWITCH}")
    if accelerator:
        fixes.append(_ACCELERATOR)
    return "; ".join(fixes) if fixes else _GENERIC


def _read(script: str) -> tuple[set[str], list[str], list[str], bool] | None:
    """(transformers Trainer names imported, Trainer subclasses defined, Trainers imported from elsewhere,
    Accelerate's Accelerator imported), or None when the source cannot be read."""
    try:
        tree = ast.parse(Path(script).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    hf_names: set[str] = set()
    other: list[str] = []
    accelerator = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            for alias in node.names:
                if top == "transformers" and alias.name in _HF_NAMES:
                    hf_names.add(alias.name)
                elif top == "accelerate" and alias.name == "Accelerator":
                    accelerator = True
                elif top not in ("transformers", "xshard") and alias.name.endswith("Trainer"):
                    other.append(f"{top}'s {alias.name}")
    subclasses = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                  and any(_base_name(base).endswith("Trainer") for base in node.bases)
                  and not any(_base_name(base) == "TrainerMixin" for base in node.bases)]
    return hf_names, subclasses, other, accelerator


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""
