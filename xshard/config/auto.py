"""Resolve DeepSpeed's ``"auto"`` values from the training script's arguments, as the HF Trainer does.

``script_args`` is a dict, an ``argparse.Namespace`` or a ``transformers.TrainingArguments``; the
names are TrainingArguments' own:

===================================  ==============================================================
key in the file                      taken from
===================================  ==============================================================
train_micro_batch_size_per_gpu       per_device_train_batch_size
gradient_accumulation_steps          gradient_accumulation_steps
train_batch_size                     world_size x micro batch x accumulation (world_size from the
                                     script, else WORLD_SIZE; left unset when unknown: it is only
                                     a consistency check, xshard derives it at run time)
gradient_clipping                    max_grad_norm
optimizer.params.lr                  learning_rate
optimizer.params.betas               [adam_beta1, adam_beta2]
optimizer.params.eps                 adam_epsilon
optimizer.params.weight_decay        weight_decay
scheduler.params.warmup_min_lr       0
scheduler.params.warmup_max_lr       learning_rate
scheduler.params.total_num_steps     max_steps (> 0) or num_training_steps
scheduler.params.warmup_num_steps    warmup_steps (>= 1), else ceil(warmup_ratio x total steps), at least 1
bf16.enabled / fp16.enabled          bf16 / fp16
===================================  ==============================================================

Any other ``"auto"`` is left for the reader: on a key xshard ignores it means "let the framework
choose" (and xshard does); on a key xshard maps it is invalid.

A script argument whose value is ``LATER`` is known only at run time (the Accelerator gives the
micro-batch this way: it is the batch size of the data loader it prepares; ``xshard launch`` gives
every setting its script's command line does not spell out, ``xshard.config.script_argv``): its
``"auto"`` keys are left out of the result, and filled when the value is known.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

from xshard.config.values import XShardConfigError, is_auto


class _Missing(Exception):
    pass


class _Deferred(Exception):
    """The setting is ``LATER``: every ``"auto"`` computed from it is left for run time."""


class _Later:
    def __repr__(self) -> str:
        return "LATER"


#: a script argument's value that is known only at run time (see the module docstring)
LATER: Any = _Later()


class ScriptValues(dict):
    """``script_args`` as a dict, with the remedy an error names for the ``"auto"`` values it cannot give."""

    def __init__(self, values: Mapping[str, Any], missing_fix: str | None = None) -> None:
        super().__init__(values)
        #: one sentence: how to do without the settings these values lack
        self.missing_fix = missing_fix


class ScriptArgs:
    """Read access to the training script's settings, whatever object holds them."""

    def __init__(self, args: Any, env: Mapping[str, str]) -> None:
        self._args = args
        self._env = env

    def get(self, name: str) -> Any:
        """The value of ``name``, or raise _Missing when the script did not give one."""
        if self._args is None:
            raise _Missing(name)
        if isinstance(self._args, Mapping):
            value = self._args.get(name)
        else:
            value = getattr(self._args, name, None)
        if value is None:
            raise _Missing(name)
        if value is LATER:
            raise _Deferred(name)
        return value

    def world_size(self) -> int | None:
        """The number of processes: the script's ``world_size``, else torchrun's WORLD_SIZE (None
        when neither is known, or when the script's is known only at run time)."""
        try:
            self.get("world_size")
        except _Deferred:
            return None
        except _Missing:
            pass
        for read in (lambda: self.get("world_size"), lambda: self._env["WORLD_SIZE"]):
            try:
                world = int(read())
            except (_Missing, KeyError, TypeError, ValueError, OverflowError):
                continue
            return world if world >= 1 else None
        return None


def _total_steps(args: ScriptArgs, data: dict) -> int:
    for name in ("max_steps", "num_training_steps"):
        try:
            steps = int(args.get(name))
        except _Missing:
            continue
        if steps > 0:
            return steps
    written = data.get("scheduler", {}).get("params", {}).get("total_num_steps")
    if isinstance(written, int) and not isinstance(written, bool) and written > 0:
        return written
    raise _Missing("max_steps")


def _optional(args: ScriptArgs, name: str) -> Any:
    try:
        return args.get(name)
    except _Missing:
        return None


def _warmup_steps(args: ScriptArgs, data: dict) -> int:
    steps, ratio = _optional(args, "warmup_steps"), _optional(args, "warmup_ratio")
    if steps is None and ratio is None:
        raise _Missing("warmup_steps")
    if steps is not None and float(steps) >= 1:
        return int(steps)
    if steps is not None and float(steps) > 0:
        ratio = steps  # TrainingArguments reads warmup_steps < 1 as a ratio of the total steps
    ratio = float(ratio or 0.0)
    # at least 1 step, as the HF Trainer fills it (DeepSpeed rejects 0 warmup steps)
    return max(1, math.ceil(_total_steps(args, data) * ratio)) if ratio > 0 else 1


def _batch(args: ScriptArgs, data: dict) -> int | None:
    world = args.world_size()
    micro = data.get("train_micro_batch_size_per_gpu")
    accum = data.get("gradient_accumulation_steps", 1)
    numbers = [world, micro, accum]
    if (isinstance(world, int) and isinstance(micro, int) and isinstance(accum, int)
            and not any(isinstance(n, bool) for n in numbers)):
        return world * micro * accum
    return LATER if micro is None else None


# key path -> (what provides it, how to compute it); train_batch_size is resolved last, from the rest
_RULES: dict[str, tuple[str, Callable[[ScriptArgs, dict], Any]]] = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size",
                                       lambda a, d: a.get("per_device_train_batch_size")),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",
                                    lambda a, d: a.get("gradient_accumulation_steps")),
    "gradient_clipping": ("max_grad_norm", lambda a, d: a.get("max_grad_norm")),
    "optimizer.params.lr": ("learning_rate", lambda a, d: a.get("learning_rate")),
    "optimizer.params.betas": ("adam_beta1 and adam_beta2",
                               lambda a, d: [a.get("adam_beta1"), a.get("adam_beta2")]),
    "optimizer.params.eps": ("adam_epsilon", lambda a, d: a.get("adam_epsilon")),
    "optimizer.params.weight_decay": ("weight_decay", lambda a, d: a.get("weight_decay")),
    "scheduler.params.warmup_min_lr": ("nothing (always 0)", lambda a, d: 0.0),
    "scheduler.params.warmup_max_lr": ("learning_rate", lambda a, d: a.get("learning_rate")),
    "scheduler.params.total_num_steps": ("max_steps or num_training_steps", _total_steps),
    "scheduler.params.warmup_num_steps": ("warmup_steps or warmup_ratio (with max_steps)", _warmup_steps),
    "bf16.enabled": ("bf16", lambda a, d: a.get("bf16")),
    "bfloat16.enabled": ("bf16", lambda a, d: a.get("bf16")),
    "fp16.enabled": ("fp16", lambda a, d: a.get("fp16")),
    "train_batch_size": ("world_size x per_device_train_batch_size x gradient_accumulation_steps", _batch),
}

AUTO_KEYS = tuple(_RULES)


def _slot(data: dict, path: str) -> tuple[dict | None, str]:
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) and last in node else None), last


def resolve_auto(data: Mapping[str, Any], script_args: Any = None,
                 env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A copy of ``data`` with every resolvable ``"auto"`` replaced by the script's value.

    Raises XShardConfigError listing every ``"auto"`` that needs a setting the script did not give,
    with the remedy ``ScriptValues.missing_fix`` names (by default: pass ``script_args``, or write the
    values into the file).
    """
    out = copy.deepcopy(dict(data))
    args = ScriptArgs(script_args, env or {})
    missing: list[str] = []
    for path, (provider, compute) in _RULES.items():
        slot, key = _slot(out, path)
        if slot is None or not is_auto(slot[key]):
            continue
        try:
            value = compute(args, out)
            if value is LATER:
                del slot[key]
            else:
                slot[key] = value
        except _Deferred:
            del slot[key]
        except _Missing:
            missing.append(f"{path} <- {provider}")
        except (TypeError, ValueError, OverflowError) as exc:
            raise XShardConfigError(
                f"{path} is 'auto' but the script's {provider} is not a number ({exc})"
            ) from None
    if missing:
        raise XShardConfigError(
            f"these 'auto' values need the training script's settings: {'; '.join(missing)}. "
            + (getattr(script_args, "missing_fix", None) or "Pass script_args (a dict, an argparse.Namespace or transformers.TrainingArguments) to "
                      "XShardConfig.load(), or write the values into the file.")
        )
    return out
