"""The Backend: the few facts and operations that differ per device family.

Everything device-specific that the sharded core and the user API need goes through one of these
objects; nothing outside ``backends/`` names a device family. A Backend knows nothing of sharding.

A subclass states its identity as class attributes and overrides only what differs from the
torch.distributed default implemented here (cpu, cuda and npu share almost all of it).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .collectives import Collectives, DistCollectives, SingleProcessCollectives
from .errors import BackendUnavailableError, WorldEnvironmentError, WorldSizeError

log = logging.getLogger("xshard.backends")

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = "29500"


@dataclass(frozen=True)
class World:
    """This process's place in the job, read from torchrun's environment contract."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> World:
        """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; one process when none is set."""
        env = os.environ if env is None else env

        def read(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise WorldEnvironmentError(
                    f"environment variable {name}={raw!r} is not an integer: check the launcher's environment"
                ) from None

        world_size = read("WORLD_SIZE", 1)
        rank = read("RANK", 0)
        local_rank = read("LOCAL_RANK", rank)
        local_world_size = read("LOCAL_WORLD_SIZE", world_size)
        if world_size < 1:
            raise WorldEnvironmentError(f"WORLD_SIZE={world_size} must be at least 1")
        if not 0 <= rank < world_size:
            raise WorldEnvironmentError(
                f"RANK={rank} is outside WORLD_SIZE={world_size}: check the launcher's environment"
            )
        if local_rank < 0:
            raise WorldEnvironmentError(f"LOCAL_RANK={local_rank} is negative: check the launcher's environment")
        return cls(rank, world_size, local_rank, local_world_size)


class Backend:
    """One device family: identity, probing, devices, precision, process group, collectives, hooks.

    Subclasses set the class attributes below and override what differs. Instances are cheap;
    vendor modules are imported lazily (``import torch_npu`` on a machine without CANN may call
    ``sys.exit``: probes catch that and report the cause, see ``_vendor_import``).
    """

    #: registry name, the value of XSHARD_BACKEND that selects it
    name: ClassVar[str] = ""
    #: torch device type ("cuda", "npu", "xla", "mps", "cpu")
    device_type: ClassVar[str] = ""
    #: torch.distributed backend name, or None when the backend has no c10d process group
    dist_backend: ClassVar[str | None] = None
    #: environment variable that restricts which devices the vendor runtime sees
    visible_devices_env: ClassVar[str | None] = None
    #: does the process group implement ReduceOp.AVG? (NCCL yes; HCCL, gloo, XLA: SUM then divide)
    native_avg: ClassVar[bool] = False
    #: the most processes one job may have (MPS: 1)
    max_world_size: ClassVar[int | None] = None
    #: vendor package the backend needs, with how to install it (for error messages and `xshard env`)
    vendor_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""
    #: other environment variables that change how this backend behaves (shown by `xshard env`)
    related_env_vars: ClassVar[tuple[str, ...]] = ()
    #: tensors have resizable storage: the sharded core frees full parameters with
    #: ``untyped_storage().resize_(0)`` (False: it replaces ``.data`` instead, as on XLA)
    frees_storage_by_resize: ClassVar[bool] = True
    #: the device compiles whole graphs (XLA): every new tensor shape is a new compilation, so the
    #: data path keeps shapes static and nothing reads device values in the middle of a step
    compiles_graphs: ClassVar[bool] = False

    def __init__(self, world: World | None = None) -> None:
        self.world = world if world is not None else World.from_env()
        self._collectives: Collectives | None = None
        self._owns_process_group = False
        self._timeout: datetime.timedelta | None = None

    # ------------------------------------------------------------------ probing
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (what is missing and how to get it), or None if it can.

        Must have no side effects beyond importing the vendor module.
        """
        raise NotImplementedError

    @classmethod
    def is_available(cls) -> bool:
        """True when this backend can run on this machine."""
        return cls.unavailable_reason() is None

    @classmethod
    def auto_skip_reason(cls) -> str | None:
        """Why ``auto`` passes over this backend although it can run (XLA on a CPU), or None."""
        return None

    @classmethod
    def vendor_version(cls) -> str | None:
        """Version of the vendor package (torch_npu, torch_xla), if any."""
        return None

    @classmethod
    def runtime_initialized(cls) -> bool:
        """Has the vendor runtime started in this process (so it no longer reads its variables)?

        Never starts the runtime or imports a vendor module that is not imported yet.
        """
        return False

    @classmethod
    def format_visible_devices(cls, ids: list[int]) -> str:
        """The value of ``visible_devices_env`` that exposes devices ``ids`` (validated, distinct)."""
        return ",".join(str(i) for i in ids)

    @classmethod
    def default_env(cls) -> dict[str, str]:
        """Variables this backend wants in a process's environment unless the user set them
        (the launcher puts them into the environment of the processes it starts)."""
        return {}

    @classmethod
    def apply_default_env(cls, env: dict[str, str] | None = None) -> dict[str, str]:
        """Put ``default_env()`` into ``env`` (default: os.environ), never overriding the user's
        values; returns and logs what it set."""
        env = os.environ if env is None else env
        added = {k: v for k, v in cls.default_env().items() if k not in env}
        for key, value in added.items():
            env[key] = value
            log.info("%s: set %s=%s (it was unset; export it yourself to choose another value)", cls.name, key, value)
        return added

    # ------------------------------------------------------------------ devices
    def device_module(self) -> Any:
        """The torch.<device_type> module (torch.cuda, torch.npu, torch.mps)."""
        return getattr(torch, self.device_type)

    def device_count(self) -> int:
        """Number of devices visible to this process."""
        return int(self.device_module().device_count())

    def device(self, local_rank: int | None = None) -> torch.device:
        """The device this process computes on."""
        index = self.world.local_rank if local_rank is None else local_rank
        return torch.device(self.device_type, index)

    def set_device(self, local_rank: int | None = None) -> None:
        """Bind this process to its device; called before the process group starts."""
        index = self.world.local_rank if local_rank is None else local_rank
        count = self.device_count()
        if index >= count:
            raise BackendUnavailableError(
                f"{self.name}: local rank {index} needs device {index}, but only {count} "
                f"{self.device_type} device(s) are visible"
                + (f" ({self.visible_devices_env}={os.environ[self.visible_devices_env]!r})"
                   if self.visible_devices_env and self.visible_devices_env in os.environ else "")
                + ": start fewer processes per node (--nproc) or make more devices visible"
            )
        self.device_module().set_device(index)

    def synchronize(self) -> None:
        """Wait for all queued work on this process's device."""
        self.device_module().synchronize()

    def manual_seed(self, seed: int) -> None:
        """Seed torch and this device's generators."""
        torch.manual_seed(seed)

    def rng_state(self) -> torch.Tensor | None:
        """This device's RNG state (None where torch's CPU generator covers it)."""
        return self.device_module().get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore what ``rng_state`` returned."""
        if state is not None:
            self.device_module().set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        """Bytes allocated now and at peak on this process's device."""
        mod = self.device_module()
        return {"allocated": int(mod.memory_allocated()), "peak": int(mod.max_memory_allocated())}

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak measurement."""
        self.device_module().reset_peak_memory_stats()

    # ------------------------------------------------------------------ precision
    def supports(self, dtype: torch.dtype) -> bool:
        """Can this device compute in ``dtype``? fp32 always; fp16/bf16 per device."""
        return dtype in (torch.float32, torch.float16, torch.bfloat16)

    def autocast(self, dtype: torch.dtype | None = None, enabled: bool = True) -> contextlib.AbstractContextManager:
        """torch.autocast for this device's real device type (never a hard-coded "cuda")."""
        if dtype is None or dtype == torch.float32 or not enabled:
            return contextlib.nullcontext()
        if not self.supports(dtype):
            raise ValueError(
                f"{self.name}: {dtype} is not supported on this device; use one of "
                f"{[str(d) for d in (torch.float16, torch.bfloat16) if self.supports(d)] or ['float32 only']}"
            )
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def grad_scaler(self, enabled: bool = True, **settings: Any) -> Any:
        """A GradScaler for fp16 training on this device: the vendor's own class where it has one.

        ``settings``: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, as
        ``torch.amp.GradScaler`` takes them. The sharded core makes the verdict agree across ranks.
        """
        return torch.amp.GradScaler(self.device_type, enabled=enabled, **settings)

    # ------------------------------------------------------------------ distributed
    def check_world(self) -> None:
        """Refuse a world this backend cannot run, with the reason."""
        if self.max_world_size is not None and self.world.world_size > self.max_world_size:
            raise WorldSizeError(
                f"{self.name} runs at most {self.max_world_size} process(es), but WORLD_SIZE="
                f"{self.world.world_size}: {self.world_size_hint()}"
            )

    def world_size_hint(self) -> str:
        """Why the world size is limited, and what to do instead."""
        return "start fewer processes"

    def init_process_group(self, timeout: datetime.timedelta | float | None = None) -> None:
        """Join the job's process group (torchrun's env contract; one process needs no variables).

        Binds the device for the local rank first, as NCCL and HCCL require.
        """
        self.check_world()
        timeout = _as_timedelta(timeout)
        self._timeout = timeout
        if self.world.world_size > 1 or self.dist_backend is not None:
            self.set_device()
        if self.world.world_size == 1 or self.dist_backend is None:
            return
        if dist.is_initialized():
            # Someone (the user, another library) started it: use it if it is this job's world.
            if dist.get_world_size() != self.world.world_size or dist.get_rank() != self.world.rank:
                raise WorldEnvironmentError(
                    f"a process group is already running as rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"but the environment says rank {self.world.rank} of {self.world.world_size}: "
                    "start the process group once, with the launcher's RANK and WORLD_SIZE"
                )
            return
        os.environ.setdefault("MASTER_ADDR", DEFAULT_MASTER_ADDR)
        os.environ.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)
        kwargs: dict[str, Any] = {
            "backend": self.dist_backend,
            "rank": self.world.rank,
            "world_size": self.world.world_size,
        }
        if timeout is not None:
            kwargs["timeout"] = timeout
        kwargs.update(self.process_group_options())
        dist.init_process_group(**kwargs)
        self._owns_process_group = True
        log.debug("process group %s: rank %d of %d", self.dist_backend, self.world.rank, self.world.world_size)

    def process_group_options(self) -> dict[str, Any]:
        """Extra keyword arguments for ``torch.distributed.init_process_group`` on this backend."""
        return {}

    def destroy_process_group(self) -> None:
        """Leave the process group this backend started (no-op otherwise)."""
        if self._collectives is not None and self._collectives.monitor is not None:
            self._collectives.monitor.stop()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False
        self._collectives = None

    @property
    def collectives(self) -> Collectives:
        """The collectives of this job: a no-op set for one process, c10d ones otherwise."""
        if self._collectives is None:
            self._collectives = self._make_collectives()
        return self._collectives

    def _make_collectives(self) -> Collectives:
        if self.world.world_size == 1:
            return SingleProcessCollectives()
        if not dist.is_initialized():
            raise RuntimeError(
                f"{self.name}: WORLD_SIZE={self.world.world_size} but no process group is running: "
                "call backend.init_process_group() (Accelerator does this) first"
            )
        timeout = self._timeout.total_seconds() if self._timeout is not None else None
        return DistCollectives(native_avg=self.native_avg, device=self.device(), timeout=timeout,
                               **self.collective_options())

    def collective_options(self) -> dict[str, Any]:
        """Per-backend choices of how DistCollectives implements each operation."""
        return {}

    # ------------------------------------------------------------------ training hooks
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step an optimizer whose gradients are already reduced (never reduce them again)."""
        optimizer.step()

    def checkpoint_wrapper(self, module: torch.nn.Module) -> torch.nn.Module:
        """Make ``module`` recompute its activations in backward (in place; names unchanged)."""
        from .checkpointing import checkpoint_forward

        return checkpoint_forward(module)

    def wrap_dataloader(self, loader: Any) -> Any:
        """Wrap a data loader so batches arrive on this device (XLA: MpDeviceLoader)."""
        return loader

    def mark_step(self) -> None:
        """End of a training step (XLA cuts the graph here; eager devices do nothing)."""

    def optimizer_step_patch(self) -> Any:
        """Undo-able patch of a vendor step function that would reduce gradients again, held while a
        sharded model lives (XLA: ``xm.optimizer_step``); an object with ``restore()``. Default: none."""
        return NoPatch()

    def launcher(self) -> str:
        """How `xshard launch` starts local processes: "torchrun", "xla" or "single"."""
        return "torchrun"

    # ------------------------------------------------------------------ reporting
    def describe(self) -> dict[str, Any]:
        """Facts for `xshard env`."""
        facts: dict[str, Any] = {
            "backend": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
            "native_avg": self.native_avg,
            "vendor_module": self.vendor_module,
            "vendor_version": self.vendor_version(),
        }
        try:
            facts["device_count"] = self.device_count()
        except Exception as exc:  # a report must not crash on a half-working runtime
            facts["device_count"] = f"unknown ({type(exc).__name__}: {exc})"
        facts["bf16"] = self.supports(torch.bfloat16)
        facts["fp16"] = self.supports(torch.float16)
        return facts

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.world.rank}, world_size={self.world.world_size})"


class NoPatch:
    """A step patch that changes nothing (backends without a vendor step function to patch)."""

    def restore(self) -> None:
        """Nothing to undo."""

    def __enter__(self) -> NoPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """A process-group timeout given as seconds or a timedelta; None keeps torch's default."""
    if timeout is None:
        return None
    if not isinstance(timeout, datetime.timedelta):
        try:
            timeout = datetime.timedelta(seconds=float(timeout))
        except (TypeError, ValueError):
            raise ValueError(f"timeout={timeout!r} is not a number of seconds or a timedelta") from None
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout} must be positive (seconds, or a timedelta)")
    return timeout


@contextlib.contextmanager
def env_override(**values: str | None) -> Iterator[None]:
    """Set or unset environment variables for the duration of a block (tests and the launcher)."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
