"""The one table of precision spellings: every name xshard accepts for a mixed precision or a dtype.

Every reader asks this module: ``XShardConfig.mixed_precision`` and ``reduce_dtype``, the accelerate
config file and ``FullyShardedDataParallelPlugin.mixed_precision_policy``, ``Accelerator(mixed_precision=)``,
``xshard launch --mixed_precision``, the DeepSpeed ``bf16``/``bfloat16``/``fp16`` sections and the
Trainer's ``--bf16``/``--fp16``. Nothing else holds a spelling.

- ``MIXED_PRECISION``: what the mixed-precision setting may be, as xshard's config, Accelerate
  (``no``/``fp16``/``bf16``), the FSDP plugin's policy dtypes (``torch.bfloat16``) and the XLA FSDP
  settings (``bfloat16``) write it -> "no", "bf16" or "fp16".
- ``DTYPE_NAMES``: what a dtype field (``reduce_dtype``, ``communication_data_type``, ``compute_dtype``)
  may be -> "fp32", "bf16" or "fp16". It also takes ``half``/``float``, which the mixed-precision setting
  does not (Accelerate never took them there).
- ``NOT_SUPPORTED``: spellings other tools accept that xshard refuses with a reason (Accelerate's fp8).

torch is imported only by ``torch_dtype`` (reading a config needs no torch).
"""

from __future__ import annotations

from typing import Any

from xshard.config.values import XShardConfigError, fail

#: the mixed precisions xshard runs, in the order its messages list them
MIXED_PRECISION_NAMES = ("no", "bf16", "fp16")
#: the same names in the order ``accelerate launch --mixed_precision`` lists them (its users read that order)
ACCELERATE_ORDER = ("no", "fp16", "bf16")

MIXED_PRECISION = {
    "no": "no", "fp32": "no", "float32": "no", "torch.float32": "no",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "torch.float16": "fp16",
}

DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}

#: DeepSpeed's precision sections -> the mixed precision they enable
DEEPSPEED_SECTIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}

NOT_SUPPORTED = {"fp8": "fp8 is not supported by xshard"}

# name (either table's values) -> the torch dtype's attribute name; "no" computes in the model's own dtype
_TORCH_NAMES = {"no": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_mixed_precision(where: str, value: Any) -> str:
    """"no", "bf16" or "fp16" from any accepted spelling; None and False (YAML's unquoted ``no``) mean "no".

    Raises XShardConfigError naming ``where``, the value and the accepted names.
    """
    if value is None or value is False:
        return "no"
    key = value.strip().lower() if isinstance(value, str) else None
    if key in MIXED_PRECISION:
        return MIXED_PRECISION[key]
    expected = "one of " + ", ".join(MIXED_PRECISION_NAMES)
    if key in NOT_SUPPORTED:
        expected += f" ({NOT_SUPPORTED[key]})"
    raise fail(where, value, expected, ("mixed_precision",))


def parse_dtype(where: str, value: Any) -> str | None:
    """A floating dtype name ("fp32", "bf16", "fp16"; torch spellings accepted), or None for None."""
    if value is None:
        return None
    key = value.strip().lower() if isinstance(value, str) else None
    if key in DTYPE_NAMES:
        return DTYPE_NAMES[key]
    raise fail(where, value, "one of " + ", ".join(dict.fromkeys(DTYPE_NAMES.values())))


def not_supported_reason(value: Any) -> str | None:
    """Why xshard refuses a spelling other tools accept (fp8), or None."""
    return NOT_SUPPORTED.get(value.strip().lower()) if isinstance(value, str) else None


def torch_dtype(name: str | None) -> Any:
    """The torch dtype of a canonical name ("fp32", "bf16", "fp16"); None for "no" and None."""
    if name is None:
        return None
    if name not in _TORCH_NAMES:
        raise XShardConfigError(f"{name!r} is not a precision name: use one of {', '.join(_TORCH_NAMES)}")
    attribute = _TORCH_NAMES[name]
    if attribute is None:
        return None
    import torch

    return getattr(torch, attribute)
