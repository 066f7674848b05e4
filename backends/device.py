"""The device role of a Backend: where tensors live and how one device computes.

``DeviceAPI`` declares every device capability the core and the Accelerator may use, each with a
default that suits an eager torch device reached through ``torch.<device_type>`` (cuda, npu, mps).
A backend overrides only what differs; ``backends/README.md`` lists the members and their rules.
Nothing here knows about processes or collectives (see ``communication.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import BackendUnavailableError
from .world import World

#: processes per CPU core a job of CPU processes may start on one node by default
CPU_PROCESSES_PER_CORE = 8


def cpu_process_bound() -> tuple[int, str]:
    """``CPU_PROCESSES_PER_CORE`` per CPU core this process may run on, and the reason in words."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CPU_PROCESSES_PER_CORE * cores, f"{CPU_PROCESSES_PER_CORE} processes per CPU core, {cores} core(s) on this node"


@dataclass(frozen=True)
class PeakTable:
    """Published dense peak TFLOPS of a family's device models, and which device names are which model.

    ``figures``: model -> {"bf16" | "fp16" | "fp32": (TFLOPS, source)}; ``models``: (lowercase words that
    must all be in ``device_name()``, model), the first match wins (so a longer name comes first).
    """

    figures: Mapping[str, Mapping[str, tuple[float, str]]]
    models: tuple[tuple[tuple[str, ...], str], ...] = ()

    def model_of(self, device_name: str) -> str | None:
        """The model of ``figures`` a device name belongs to, or None."""
        name = device_name.lower()
        for words, model in self.models:
            if all(w in name for w in words):
                return model
        return None

    def __add__(self, other: PeakTable) -> PeakTable:
        """Both tables, this one's models matched first."""
        return PeakTable({**other.figures, **self.figures}, (*self.models, *other.models))


class StepPatch:
    """A scoped change to how a script's own optimizer-step call behaves while a sharded model lives.

    The default patch changes nothing. ``restore()`` undoes the patch (idempotent); the object is
    also a context manager that restores on exit. A backend whose vendor has a step call that would
    reduce gradients again (XLA's ``xm.optimizer_step``) returns a subclass that replaces it.
    """

    def __init__(self) -> None:
        self.active = True

    def restore(self) -> None:
        """Undo the patch (nothing to undo here); calling it again does nothing."""
        self.active = False

    def __enter__(self) -> StepPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


class DeviceAPI:
    """Device, RNG, memory, dtypes, autocast, grad scaler and the per-step training hooks.

    Mixed into ``Backend``; the defaults use ``torch.<device_type>``. Members that take no
    ``local_rank`` work on this process's device (``world.local_rank``).
    """

    #: torch device type ("cuda", "npu", "xla", "mps", "cpu")
    device_type: ClassVar[str] = ""
    #: can a full parameter be freed by resizing its storage to 0 (eager devices)? False where
    #: tensors have no storage to resize (XLA): the core then replaces the tensor instead
    frees_storage_by_resize: ClassVar[bool] = True
    #: does the device's allocator keep freed blocks for the next allocation (the caching allocators of
    #: cuda, npu, mps)? False on the CPU, whose malloc hands large blocks back to the kernel: the
    #: sharded core then keeps freed full parameters' memory itself (xshard/sharding/storage_pool.py)
    allocator_caches: ClassVar[bool] = True
    #: does the device compile whole graphs (XLA)? Then each new tensor shape is a new compilation,
    #: so the data path should keep shapes static (pad batches to a few fixed widths)
    compiles_graphs: ClassVar[bool] = False
    #: can host memory be page-locked (pinned) for this device, so that a copy from the device to it runs
    #: asynchronously and at full speed? The host buffers of an async save are then pinned (and reused)
    pins_host_memory: ClassVar[bool] = False
    #: class fact: the devices one process of this backend drives, as transformers' ``TrainingArguments.n_gpu``
    #: counts them: 0 where the process computes on the host's CPUs or on an XLA device (which transformers
    #: never wraps in DataParallel), 1 where it drives one accelerator (xshard runs one device per process)
    trainer_device_count: ClassVar[int] = 1
    #: class fact: can the ``kernels`` library (transformers' hub kernels, which transformers 5.25 and newer
    #: puts on a loaded model and applies again at every ``model.train()`` / ``eval()``) kernelize a model on
    #: this device? False where it refuses the device type: ``prepare`` then turns them off for the model
    runs_hub_kernels: ClassVar[bool] = True
    #: class fact: the published dense peak TFLOPS of this family's device models, looked up by ``device_name()``
    #: (the throughput report's MFU, ``xshard estimate --machine``); empty where none is published or the
    #: peak is measured (``measured_peak_tflops``)
    peak_tflops: ClassVar[PeakTable] = PeakTable({})

    # set by Backend
    name: ClassVar[str]
    visible_devices_env: ClassVar[str | None]
    world: World

    # ------------------------------------------------------------------ devices
    def device_module(self) -> Any:
        """The torch.<device_type> module (torch.cuda, torch.npu, torch.mps)."""
        return getattr(torch, self.device_type)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer of ``nbytes`` to copy this device's tensors into (pinned where
        ``pins_host_memory``; pageable otherwise)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pins_host_memory)

    def device_count(self) -> int:
        """Number of devices visible to this process."""
        return int(self.device_module().device_count())

    def device_name(self) -> str:
        """The device's model name as its runtime reports it ("NVIDIA H100 80GB HBM3", "Ascend910B2"): what the
        throughput report looks its peak FLOPS up by (``xshard.runtime.throughput``)."""
        return str(self.device_module().get_device_name(self.device()))

    def max_processes_per_node(self) -> tuple[int, str]:
        """The most processes `xshard launch` starts on one node, and why (``XSHARD_MAX_NPROC`` overrides it):
        one per device where ``host_device_count`` knows them, else (and for any backend computing on the CPU)
        ``cpu_process_bound``."""
        count = self.host_device_count() if self.device_type != "cpu" else None
        if count:
            return count, f"the {self.name} backend sees {count} device(s) on this node, one process each"
        return cpu_process_bound()

    @classmethod
    def accelerate_distributed_type(cls) -> str:
        """Accelerate's ``DistributedType`` name for plain data parallel on this family: what
        ``accelerator.state.distributed_type`` and the Trainer's ``distributed_state`` answer for a job of
        several processes that shards nothing ("MULTI_GPU" on cuda, "XLA" on xla). Default:
        ``MULTI_<DEVICE_TYPE>`` (MULTI_CPU, MULTI_NPU, MULTI_MPS, MULTI_TPU)."""
        return f"MULTI_{cls.device_type.upper()}"

    def measured_peak_tflops(self, dtype: torch.dtype | None) -> float | None:
        """This device's peak TFLOPS in ``dtype`` as measured here, where no published figure serves (a CPU);
        None: the throughput report looks the figure up by ``device_name()``."""
        return None

    def host_device_count(self) -> int | None:
        """How many processes "one per device" means on this host, asked by `xshard launch` before
        any rank starts. It must not start the vendor runtime in the launcher's process (XLA: torch_xla
        refuses to start replicas after that). None when only the vendor's launcher can tell."""
        return self.device_count()

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

    # ------------------------------------------------------------------ random numbers
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

    # ------------------------------------------------------------------ memory
    def memory_stats(self) -> dict[str, int]:
        """Bytes allocated now and at peak on this process's device."""
        mod = self.device_module()
        return {"allocated": int(mod.memory_allocated()), "peak": int(mod.max_memory_allocated())}

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak measurement."""
        self.device_module().reset_peak_memory_stats()

    def free_memory(self) -> int | None:
        """Bytes this process's device could still allocate now, or None where the runtime does not say."""
        # torch.cuda's and torch.npu's; a device type with no torch module of its own (xla) says nothing
        mem_get_info = getattr(getattr(torch, self.device_type, None), "mem_get_info", None)
        if mem_get_info is None:
            return None
        free, _total = mem_get_info(self.device())
        return int(free)

    def empty_cache(self) -> None:
        """Hand the allocator's cached free blocks back to the device (``release_memory``, Accelerate's
        ``free_memory``), so that other processes and libraries can allocate them."""
        # torch.cuda's, torch.npu's and torch.mps's; a device type with no torch module of its own (xla) has none
        empty_cache = getattr(getattr(torch, self.device_type, None), "empty_cache", None)
        if empty_cache is not None:
            empty_cache()

    # ------------------------------------------------------------------ precision
    def supports(self, dtype: torch.dtype) -> bool:
        """Can this device compute in ``dtype`` natively (no emulation)? fp32 always; fp16/bf16 per
        device. Must not start the vendor runtime before ``set_device``."""
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
        """The vendor's GradScaler instance for fp16 training on this device (default:
        ``torch.amp.GradScaler(device_type)``). ``settings``: ``init_scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, as ``torch.amp.GradScaler`` takes them; the sharded
        core makes the verdict agree across ranks (``xshard.sharding.ShardedGradScaler``)."""
        return torch.amp.GradScaler(self.device_type, enabled=enabled, **settings)

    # ------------------------------------------------------------------ training hooks
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step an optimizer whose gradients are already reduced (never reduce them again)."""
        optimizer.step()

    def optimizer_step_patch(self) -> StepPatch:
        """A patch, held while a sharded model lives, that stops the vendor's own step call from
        reducing sharded gradients again (XLA: ``xm.optimizer_step``). Default: changes nothing."""
        return StepPatch()

    def checkpoint_wrapper(self, module: torch.nn.Module) -> torch.nn.Module:
        """Make ``module`` recompute its activations in backward (in place; names unchanged)."""
        from .activation_checkpointing import checkpoint_forward

        return checkpoint_forward(module)

    def wrap_dataloader(self, loader: Any) -> Any:
        """Wrap a data loader so batches arrive on this device (XLA: MpDeviceLoader)."""
        return loader

    def optimization_barrier(self, tensors: list[torch.Tensor]) -> None:
        """Keep a graph compiler from moving work across this point: every later use of ``tensors``
        waits for all of them (XLA: ``xm.optimization_barrier_``, in place). Eager devices run in
        program order: nothing to do."""

    def mark_step(self) -> None:
        """End of a training step (XLA cuts the graph here; eager devices do nothing)."""
