"""``generate()`` on a model whose forward gathers parameters: gather once for the call, or keep every rank stepping.

At stage 3 each forward of the model is a collective (its units are all-gathered). ``SyncedGenerate``
stands in for the model's ``generate`` while it is sharded and takes one of two paths:

- **once** (the fast path, as TRL's ``ds3_gather_for_generation``): every rank gathers the whole model
  (``summon_full_params(writeback=False)``: one all-gather per unit), then generates with no collective
  at all, so ``synced_gpus`` stays off and each rank stops when its own sequences end. It costs the whole
  model in the compute dtype on every rank for the call.
- **per unit** (the slow path): each decoding step's forward gathers every unit, so a rank whose
  sequences end early must go on running forwards until every rank's have ended, which is what
  transformers' ``synced_gpus=True`` does (it sets it by itself for DeepSpeed ZeRO-3 and FSDP models
  only). The tokens are the same: a finished rank's extra steps are discarded.

Which path: the ``generate_gathers_once`` option (True, False, or None: once when the whole model fits,
see ``GatherDecision``). Inside ``summon_full_params`` the parameters are already whole: ``generate`` runs
as it is (one rank may generate alone). Only transformers-style ``generate`` (a ``GenerationMixin``
model, or a PEFT model around one) is wrapped; any other ``generate`` is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

log = logging.getLogger("xshard.sharding")

#: what the decoding needs beside the whole parameters (KV cache, logits, activations): a share of the
#: parameters' bytes plus a fixed amount
MARGIN_FRACTION = 0.25
MARGIN_BYTES = 512 * 2**20


def generates_like_transformers(module: nn.Module) -> bool:
    """Is ``module.generate`` transformers' (``GenerationMixin``), directly or through a PEFT model?"""
    get_base_model = getattr(module, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else module
    return any(cls.__name__ == "GenerationMixin" for cls in type(inner).__mro__)


def fits(full_bytes: int, free_bytes: int | None) -> bool:
    """Does the whole model (``full_bytes`` in the compute dtype) plus the decoding margin fit in ``free_bytes``?
    An unknown free amount (None) does not fit: the per-unit path never runs out of memory where training ran."""
    if free_bytes is None:
        return False
    return full_bytes * (1 + MARGIN_FRACTION) + MARGIN_BYTES <= free_bytes


@dataclass
class GatherDecision:
    """Whether a ``generate`` call gathers the whole model once: the same answer on every rank.

    ``forced``: the option (True / False), or None to ask memory: each rank's free memory against the whole
    model (``full_bytes()``), agreed over the shard group with one small all-reduce (``agree``: the minimum
    of the ranks' 0/1), since one rank gathering alone while the others gather per unit would hang.
    """

    forced: bool | None
    full_bytes: Callable[[], int]
    free_bytes: Callable[[], int | None]
    agree: Callable[[bool], bool]

    def __call__(self) -> bool:
        if self.forced is not None:
            return self.forced
        full, free = self.full_bytes(), self.free_bytes()
        once = self.agree(fits(full, free))
        log.debug("generate: whole model %d bytes, %s bytes free here: %s", full, free,
                  "gathered once" if once else "gathered per unit and step")
        return once


class SyncedGenerate:
    """The model's ``generate``: the whole model gathered once for the call, or ``synced_gpus=True``."""

    def __init__(self, module: nn.Module, alone: Callable[[], bool], gather_once: Callable[[], bool],
                 summon: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self.module = module
        self.alone = alone  # True inside summon_full_params: forwards run no collective
        self.gather_once = gather_once
        self.summon = summon  # every unit whole for a block, changes discarded
        self.inner = module.__dict__.get("generate")  # a generate set on the instance before, kept
        #: how the last call ran: "alone", "once" or "per_unit" (what tests and benchmarks read)
        self.last_path: str | None = None
        # name, docstring and signature (inspect.signature follows __wrapped__) of the generate it stands for
        functools.update_wrapper(self, self.inner or type(module).generate.__get__(module))  # type: ignore[attr-defined]

    def _generate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).generate(self.module, *args, **kwargs)  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.alone():
            self.last_path = "alone"
            return self._generate(args, kwargs)
        if self.gather_once():
            self.last_path = "once"
            with self.summon():  # generate runs under no_grad anyway, as summon_full_params does
                return self._generate(args, kwargs)
        self.last_path = "per_unit"
        kwargs["synced_gpus"] = True
        return self._generate(args, kwargs)


def install(module: nn.Module, alone: Callable[[], bool], gather_once: Callable[[], bool],
            summon: Callable[[], contextlib.AbstractContextManager[None]]) -> Callable[[], None] | None:
    """Put ``SyncedGenerate`` in place of ``module.generate``; returns what undoes it (None: not wrapped)."""
    if not generates_like_transformers(module):
        return None
    wrapper = SyncedGenerate(module, alone, gather_once, summon)
    module.__dict__["generate"] = wrapper

    def remove() -> None:
        if module.__dict__.get("generate") is wrapper:
            if wrapper.inner is None:
                del module.__dict__["generate"]
            else:
                module.__dict__["generate"] = wrapper.inner

    return remove
