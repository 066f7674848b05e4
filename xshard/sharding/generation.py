"""``generate()`` on a model whose forward gathers parameters: every rank runs every decoding step.

At stage 3 each forward of the model is a collective (its units are all-gathered), so a rank whose
sequences end early must go on running forwards until every rank's have ended, which is what
transformers' ``synced_gpus=True`` does (it sets it by itself for DeepSpeed ZeRO-3 and FSDP models
only). ``SyncedGenerate`` stands in for the model's ``generate`` while it is sharded and passes
``synced_gpus=True`` unless the whole parameters are summoned (``summon_full_params``: no collective
runs, one rank may generate alone). The tokens are the same either way: a finished rank's extra steps
are discarded. Only transformers-style ``generate`` (a ``GenerationMixin`` model, or a PEFT model around
one) is wrapped; any other ``generate`` is left as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn


def generates_like_transformers(module: nn.Module) -> bool:
    """Is ``module.generate`` transformers' (``GenerationMixin``), directly or through a PEFT model?"""
    get_base_model = getattr(module, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else module
    return any(cls.__name__ == "GenerationMixin" for cls in type(inner).__mro__)


class SyncedGenerate:
    """The model's ``generate`` with ``synced_gpus=True`` whenever a forward needs every rank."""

    def __init__(self, module: nn.Module, alone: Callable[[], bool]) -> None:
        self.module = module
        self.alone = alone  # True inside summon_full_params: forwards run no collective
        self.inner = module.__dict__.get("generate")  # a generate set on the instance before, kept
        # name, docstring and signature (inspect.signature follows __wrapped__) of the generate it stands for
        functools.update_wrapper(self, self.inner or type(module).generate.__get__(module))  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.alone():
            kwargs["synced_gpus"] = True
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).generate(self.module, *args, **kwargs)  # type: ignore[attr-defined]


def install(module: nn.Module, alone: Callable[[], bool]) -> Callable[[], None] | None:
    """Put ``SyncedGenerate`` in place of ``module.generate``; returns what undoes it (None: not wrapped)."""
    if not generates_like_transformers(module):
        return None
    wrapper = SyncedGenerate(module, alone)
    module.__dict__["generate"] = wrapper

    def remove() -> None:
        if module.__dict__.get("generate") is wrapper:
            if wrapper.inner is None:
                del module.__dict__["generate"]
            else:
                module.__dict__["generate"] = wrapper.inner

    return remove
