"""Precision: the one owner of a job's mixed precision (name, compute and output dtypes, fp16 loss scaling).

The ``Accelerator``, the ``JobState`` and the prepared optimizers ask this object instead of deriving
anything from the precision's name, as Lightning Fabric's precision plugins own the forward's autocast,
``backward``, unscaling and the optimizer step:

- ``autocast``: the backend's autocast in the compute dtype (nothing for "no");
- ``backward``: ``loss.backward()``, through the grad scaler for fp16;
- ``optimizer_step``: the whole chain of one optimizer step, in one method: unscale -> clip -> step.
  The step goes through the backend and, for fp16, through the scaler, which skips a step whose gradients
  hold inf/nan on any rank and lowers the scale, as ``torch.amp.GradScaler`` does; it returns whether it
  stepped;
- ``unscale``, ``clip_grad_norm_``, ``clip_grad_value_``: the chain's parts, also what the loop calls
  (``accelerator.clip_grad_norm_`` ...); each optimizer is unscaled once per step, whoever asks first.

The step as one call chain: ``PreparedOptimizer.step`` (gates on the accumulation window) ->
``Precision.optimizer_step`` (unscale -> clip -> scaler) -> ``Backend.optimizer_step`` -> the optimizer.

Spellings ("bfloat16", "fp32", Accelerate's enum ...) are read by the one table in
``xshard.config.precision_names``. The sharded core's own policy (which dtype compute copies, gradient
reduction and outputs take) is ``xshard.sharding.PrecisionPolicy``, built from the config; this object
gives it the output dtype (``Accelerator.sharding_options``).

Design note: the object lives with the job machinery, not in ``xshard.sharding``, because it reads the
config's spelling table, and the core imports only ``xshard.backends``; the core's part of the fp16
story (``ShardedGradScaler``: one inf/nan verdict over every rank) stays there and is built here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from ..backends import Backend
from ..config.precision_names import MIXED_PRECISION_NAMES, parse_mixed_precision, torch_dtype
from ..sharding import ShardedGradScaler
from .grads import clip_value_


class ClipsGradients(Protocol):
    """A prepared model as clipping sees it (``xshard.sharding.ShardedModel``): its parameters and one global
    norm over every rank's gradient shards."""

    def parameters(self) -> Iterable[torch.nn.Parameter]: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...


@dataclass(frozen=True)
class GradientClip:
    """Clip ``models``' gradients to ``max_norm`` before a step; ``optimizers``' fp16 gradients are unscaled
    first (every optimizer of the job: one may share a model with another)."""

    models: Sequence[ClipsGradients]
    optimizers: Sequence[torch.optim.Optimizer]
    max_norm: float

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.models for p in m.parameters()]


class _BackendStepper:
    """What the grad scaler sees as "the optimizer": stepping it goes through the backend.

    One object per optimizer for the whole run, because the scaler keys its per-optimizer state
    (unscaled yet? inf found?) by the object's identity.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend: Backend) -> None:
        self.optimizer = optimizer
        self.backend = backend

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.backend.optimizer_step(self.optimizer)


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
        self.scaler: torch.amp.GradScaler | None = None
        #: the optimizers whose fp16 gradients were unscaled in the current step (by id)
        self._unscaled: set[int] = set()
        #: what the scaler steps for each optimizer: one object per optimizer for the whole run
        self._steppers: dict[int, _BackendStepper] = {}
        if name == "fp16":
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

    # ------------------------------------------------------------------ one optimizer step: unscale -> clip -> step
    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, clip: GradientClip | None = None) -> bool:
        """One optimizer step, the whole chain: unscale -> clip -> step. True when it stepped.

        ``clip``: clip to a global norm first (the config's ``gradient_clipping`` when the loop did not
        clip in this step; the prepared optimizer decides). The step goes through the backend
        (``Backend.optimizer_step``: never a second gradient reduction; XLA ends its graph there) and,
        for fp16, through the scaler, which skips it when any rank's gradients hold inf/nan.
        """
        if clip is not None:
            self.clip_grad_norm_(clip.models, clip.optimizers, clip.parameters(), clip.max_norm)
        stepper = self._stepper(optimizer)
        self._unscaled.discard(id(optimizer))
        if self.scaler is None:
            stepper.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(stepper)
        self.scaler.update()
        # the scale only shrinks on a skipped step
        return self.scaler.get_scale() >= before

    def unscale(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Divide these optimizers' fp16 gradients by the loss scale, each once per step (nothing without
        a scaler). Clipping calls it itself; a second call in the same step changes nothing."""
        if self.scaler is None:
            return
        for optimizer in optimizers:
            if id(optimizer) not in self._unscaled:
                self.scaler.unscale_(self._stepper(optimizer))
                self._unscaled.add(id(optimizer))

    def clip_grad_norm_(self, models: Sequence[ClipsGradients], optimizers: Iterable[torch.optim.Optimizer],
                        parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip to a global norm over every rank's gradient shards; every rank returns the same norm.

        ``optimizers``' fp16 gradients are unscaled first. Prepared models compute one norm over all
        their gradients (the core knows which are shards); parameters of no prepared model are clipped as
        plain PyTorch does.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ids = {id(p) for p in params}
        self.unscale(optimizers)
        norms = [m.clip_grad_norm_(max_norm, norm_type) for m in models if any(id(p) in ids for p in m.parameters())]
        if norms:
            return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def clip_grad_value_(self, optimizers: Iterable[torch.optim.Optimizer], gradients: list[torch.Tensor],
                         clip_value: float) -> None:
        """Clamp every element of ``gradients`` to ``[-clip_value, clip_value]``, after unscaling
        ``optimizers``' fp16 gradients (exact on shards too)."""
        self.unscale(optimizers)
        clip_value_(gradients, clip_value)

    def _stepper(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` as the scaler steps it: through the backend. The scaler reads only ``param_groups``
        and ``state`` and calls ``step``, which ``_BackendStepper`` gives, hence the cast."""
        stepper = self._steppers.get(id(optimizer))
        if stepper is None or stepper.optimizer is not optimizer:
            stepper = self._steppers[id(optimizer)] = _BackendStepper(optimizer, self.backend)
        return cast(torch.optim.Optimizer, stepper)

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, compute_dtype={self.compute_dtype}, scaler={self.scaler is not None})"
