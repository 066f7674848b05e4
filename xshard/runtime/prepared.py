"""The optimizer and LR scheduler that ``Accelerator.prepare`` hands back.

``PreparedOptimizer`` is a ``torch.optim.Optimizer`` (isinstance checks keep working) that forwards
its state to the user's optimizer and changes only when things happen:

- ``step()`` and ``zero_grad()`` do nothing inside an accumulation window (``job.sync_gradients``
  False);
- ``step()`` at the end of a window hands the step to the precision owner
  (``Precision.optimizer_step``: unscale -> clip to the job's ``gradient_clipping`` if the loop did not
  clip in this step -> step through the backend, and for fp16 through the grad scaler, which skips a step
  with inf/nan gradients);
- ``step_was_skipped`` is True after an fp16 step skipped for inf/nan gradients.

Everything else reaches the user's optimizer, as Accelerate's ``AcceleratedOptimizer`` does:
``param_groups`` / ``state`` / ``defaults``, ``state_dict`` / ``load_state_dict``, ``add_param_group``,
``train()`` / ``eval()`` (schedule-free optimizers; nothing where the optimizer has none) and the hook
registrations, which register on the user's optimizer: its step hooks run at each real step (inside
``step`` of the optimizer, so never for a step skipped in a window or for fp16 inf/nan gradients).
Design note: Accelerate 1.15's wrapper inherits the registrations from torch without torch's
``__init__`` and raises ``AttributeError`` on them; a script cannot rely on that, so here they work.

``PreparedScheduler`` steps as Accelerate's ``AcceleratedScheduler`` does, so a schedule tuned for an
Accelerate script gives the same learning rates here:

- at the end of an accumulation window only (inside it, a call only counts in ``_step_count`` when
  ``adjust_scheduler``, which keeps torch from warning about the call order);
- never after a skipped fp16 step;
- ``num_processes`` times per optimizer step, because each optimizer step consumed ``num_processes``
  loader batches (a schedule written in batches of one process stays right at any process count),
  except with ``split_batches`` (the loader's batch already is the global batch: once);
- with ``step_scheduler_with_optimizer=False`` on every call, whatever the optimizer did.

Both receive the job's ``JobState`` explicitly; neither knows the Accelerator.
"""

from __future__ import annotations

import inspect
import os
import uuid
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from .job import JobOptimizer, JobState
from .mixed_precision import GradientClip

if TYPE_CHECKING:
    # the model's module imports torch._dynamo (about a second, and its cache folder): named for the type checker only
    from ..sharding import ShardedModel


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped at accumulation boundaries through the backend and scaler."""

    def __init__(self, optimizer: torch.optim.Optimizer, job: JobState, model: ShardedModel | None = None) -> None:
        # Optimizer.__init__ is not called on purpose: all state lives in the wrapped optimizer.
        self.optimizer = optimizer
        self.job = job
        self.model = model
        self.stepped = False
        self._skipped = False
        self._token = uuid.uuid4().hex  # names this optimizer's job and model when pickled (``__getstate__``)
        _LIVE_OPTIMIZERS[self._token] = self

    # state forwarding (schedulers and user code read and write these)
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The job's fp16 grad scaler that steps this optimizer, or None (Accelerate's ``scaler``)."""
        return self.job.scaler

    @property
    def device_placement(self) -> bool:
        """Always True: the optimizer's state lives where its parameters (or their shards) do."""
        return True

    @property
    def step_was_skipped(self) -> bool:
        """True after an fp16 step skipped for inf/nan gradients (every rank agrees), as Accelerate's."""
        return self._skipped

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (over its parameter shards at stages 1-3)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on the same rank, world size and stage."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the user's optimizer."""
        self.optimizer.add_param_group(param_group)

    def train(self) -> None:
        """The user's optimizer's ``train()`` (schedule-free optimizers: training weights); nothing without one."""
        train = getattr(self.optimizer, "train", None)
        if callable(train):
            train()

    def eval(self) -> None:
        """The user's optimizer's ``eval()`` (schedule-free optimizers: averaged weights); nothing without one."""
        evaluate = getattr(self.optimizer, "eval", None)
        if callable(evaluate):
            evaluate()

    # the hooks register on the user's optimizer (the module docstring); each returns torch's handle
    def register_step_pre_hook(self, hook: Any) -> RemovableHandle:
        """Run ``hook(optimizer, args, kwargs)`` before each real step of the user's optimizer."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> RemovableHandle:
        """Run ``hook(optimizer, args, kwargs)`` after each real step of the user's optimizer."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer)`` before ``state_dict()``."""
        return self.optimizer.register_state_dict_pre_hook(hook, prepend=prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer, state_dict)`` after ``state_dict()``."""
        return self.optimizer.register_state_dict_post_hook(hook, prepend=prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer, state_dict)`` before ``load_state_dict()``."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend=prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> RemovableHandle:
        """Run ``hook(optimizer)`` after ``load_state_dict()``."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend=prepend)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients, except inside an accumulation window (they are still accumulating).

        As Accelerate: ``set_to_none`` defaults to True, and is an error for an optimizer whose
        ``zero_grad`` does not take it."""
        if not self.job.sync_gradients:
            return
        if "set_to_none" in inspect.signature(self.optimizer.zero_grad).parameters:
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        elif set_to_none is not None:
            raise ValueError(f"zero_grad(set_to_none=...): {type(self.optimizer).__name__}.zero_grad() does not "
                             "take set_to_none; call zero_grad() without it")
        else:
            self.optimizer.zero_grad()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # a closure is refused, so no loss is returned
        """Step at the end of an accumulation window; a no-op inside it.

        The whole step, as one chain: the window gates here; the precision owner unscales, clips (the
        config's ``gradient_clipping``, unless the loop clipped in this step) and steps through the backend
        and the fp16 scaler; the job counts the step.
        """
        if closure is not None:
            raise ValueError("a prepared optimizer does not take a closure: compute the loss before step()")
        self.stepped = False
        job = self.job
        if not job.sync_gradients:
            return
        clip = None
        if job.gradient_clipping > 0 and not job.clipped and self.model is not None:
            clip = GradientClip([self.model], job.user_optimizers(), job.gradient_clipping)
        self.stepped = job.precision.optimizer_step(self.optimizer, clip=clip)
        self._skipped = not self.stepped
        job.finish_optimizer_step()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with a copy of the user's optimizer, as Accelerate's; the job and model (the process
        group, the shards) are named by reference: unpickled in this process they are the live ones."""
        kept = {k: v for k, v in self.__dict__.items() if k not in ("job", "model")}
        return {**kept, "_pid": os.getpid()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        pid, token = state.pop("_pid"), state["_token"]
        live = _LIVE_OPTIMIZERS.get(token) if pid == os.getpid() else None
        if live is None:
            raise RuntimeError("a prepared optimizer unpickles only in the process of its Accelerator (it steps "
                               "that job's shards): pickle optimizer.optimizer or optimizer.state_dict() instead")
        self.__dict__.update(state, job=live.job, model=live.model)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    if not TYPE_CHECKING:  # hidden from the type checker, so that a misspelt member is an error there
        def __getattr__(self, name: str) -> Any:
            raise _missing(self, name)


#: Accelerate's members of its wrappers that hold Accelerate's state singletons -> where xshard answers them
_STATE_MEMBERS = {"accelerator_state": "accelerator.state", "gradient_state": "accelerator.gradient_state"}


def _missing(wrapper: object, name: str) -> AttributeError:
    """The error for a member the prepared object lacks; Accelerate's state members name the Accelerator's."""
    kind = type(wrapper).__name__
    if name in _STATE_MEMBERS:
        return AttributeError(f"{kind}.{name} is Accelerate's; the prepared objects do not hold the Accelerator's "
                              f"state: read {_STATE_MEMBERS[name]}")
    return AttributeError(f"{kind!r} object has no attribute {name!r}")


#: this process's prepared optimizers by pickling token (weak: a dropped optimizer is forgotten)
_LIVE_OPTIMIZERS: weakref.WeakValueDictionary[str, PreparedOptimizer] = weakref.WeakValueDictionary()


class PreparedScheduler:
    """An LR scheduler stepped by Accelerate's rule (see the module docstring)."""

    def __init__(self, scheduler: Any, optimizers: list[JobOptimizer], job: JobState) -> None:
        self.scheduler = scheduler
        #: the prepared optimizers this schedule follows (its own, else every prepared one)
        self.optimizers = optimizers
        self.job = job

    @property
    def split_batches(self) -> bool:
        """A loader's batch is the global batch: the schedule steps once per optimizer step."""
        return self.job.split_batches

    @property
    def step_with_optimizer(self) -> bool:
        """The schedule follows the optimizer's steps (``step_scheduler_with_optimizer``), else every call."""
        return self.job.step_scheduler_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule as Accelerate's ``AcceleratedScheduler.step`` does."""
        job = self.job
        if not job.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not job.sync_gradients:
            if job.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(1 if job.split_batches else job.world_size):
            # OneCycleLR raises past its total_steps (a last partial window can get there)
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        """The scheduler's ``print_lr`` (torch removed it from its schedulers: then an AttributeError, as in
        Accelerate)."""
        return self.scheduler.print_lr(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    if not TYPE_CHECKING:  # the scheduler's other members at run time; the type checker sees only the above
        def __getattr__(self, name: str) -> Any:
            if name in _STATE_MEMBERS or "scheduler" not in self.__dict__:
                raise _missing(self, name)
            return getattr(self.__dict__["scheduler"], name)
