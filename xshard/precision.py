"""Precision: the one owner of a job's mixed precision (name, compute and output dtypes, fp16 loss scaling).

The ``Accelerator``, the ``JobState`` and the prepared optimizers ask this object instead of deriving
anything from the precision's name, as Lightning Fabric's precision plugins own the forward's autocast,
``backward``, unscaling and the optimizer step:

- ``autocast``: the backend's autocast in the compute dtype (nothing for "no");
- ``backward``: ``loss.backward()``, through the grad scaler for fp16;
- ``unscale``: divide an optimizer's fp16 gradients by the loss scale (before clipping);
- ``step``: the optimizer step, through the scaler for fp16, which skips a step whose gradients hold
  inf/nan on any rank and lowers the scale, as ``torch.amp.GradScaler`` does; returns whether it stepped.

Spellings ("bfloat16", "fp32", Accelerate's enum ...) are read by the one table in
``xshard.config.precision``. The sharded core's own policy (which dtype compute copies, gradient
reduction and outputs take) is ``xshard.sharding.PrecisionPolicy``, built from the config; this object
gives it the output dtype (``Accelerator.sharding_options``).

Design note: the object lives with the job machinery, not in ``xshard.sharding``, because it reads the
config's spelling table, and the core imports only ``xshard.backends``; the core's part of the fp16
story (``ShardedGradScaler``: one inf/nan verdict over every rank) stays there and is built here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .backends import Backend
from .config.precision import MIXED_PRECISION_NAMES, parse_mixed_precision, torch_dtype


class Precision:
    """A job's mixed precision: "no", "bf16" or "fp16", with the dtypes and the fp16 grad scaler.

    Build one with ``Precision.choose`` (reads any accepted spelling and checks the device).

    Attributes:
        name: "no", "bf16" or "fp16".
        compute_dtype: the dtype the forward computes in under autocast (None for "no").
        output_dtype: the dtype low-precision outputs of a prepared model are cast to (fp32 under mixed
            precision, as Accelerate returns them; None for "no").
        scaler: the backend's fp16 grad scaler with a verdict every rank shares (None unless fp16).
    """

    def __init__(self, name: str, backend: Backend, scaler_settings: dict[str, Any] | None = None) -> None:
        self.name = name
        self.backend = backend
        self.compute_dtype: torch.dtype | None = torch_dtype(name)
        self.output_dtype: torch.dtype | None = torch.float32 if self.compute_dtype is not None else None
        self.scaler: Any = None
        if name == "fp16":
            from .sharding import ShardedGradScaler

            self.scaler = ShardedGradScaler.for_backend(backend, **(scaler_settings or {}))

    @classmethod
    def choose(cls, value: Any, backend: Backend, scaler_settings: dict[str, Any] | None = None) -> Precision:
        """The precision ``value`` names (any accepted spelling), on a device that computes in it.

        Raises ValueError naming the accepted spellings, or the precisions this device supports.
        """
        name = parse_mixed_precision("mixed_precision", value)
        if not cls.supported(backend, name):
            usable = [n for n in MIXED_PRECISION_NAMES if cls.supported(backend, n)]
            raise ValueError(f"mixed_precision={value!r}: the {backend.name} backend cannot compute in "
                             f"{torch_dtype(name)} on this device; use one of: {', '.join(usable)} "
                             "(Accelerator.supports tells which)")
        return cls(name, backend, scaler_settings)

    @staticmethod
    def supported(backend: Backend, precision: str | torch.dtype) -> bool:
        """Can ``backend``'s device compute in ``precision`` (any accepted spelling, or a torch dtype)?"""
        if isinstance(precision, torch.dtype):
            dtype = precision
        else:
            dtype = torch_dtype(parse_mixed_precision("mixed_precision", precision))
        return dtype is None or dtype == torch.float32 or backend.supports(dtype)

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """The backend's autocast in the compute dtype; nothing for "no" or ``enabled=False``."""
        return self.backend.autocast(self.compute_dtype, enabled=enabled and self.compute_dtype is not None)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``; fp16 multiplies the loss by the scale first."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def unscale(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s fp16 gradients by the loss scale (nothing without a scaler).

        Once per optimizer per step: the scaler refuses a second call before ``step``.
        """
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any) -> bool:
        """Step ``optimizer`` (an object whose ``step()`` updates the parameters); True when it stepped.

        fp16: through the scaler, which skips the step when any rank's gradients hold inf/nan and then
        lowers the scale; the scale only shrinks on such a step, so a smaller scale means skipped.
        """
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, compute_dtype={self.compute_dtype}, scaler={self.scaler is not None})"
