"""XLA backend: TPUs (and XLA:CPU for testing) through torch_xla's PJRT runtime.

There is no c10d process group: the world comes from torch_xla's runtime (one replica per device,
started by torch_xla's launcher), and collectives are ``xm.*`` replica collectives. XLA traces
lazily, so a training step ends with ``mark_step``; full parameters are freed by replacing the
tensor, not by resizing storage (XLA tensors have none).

torch_xla is imported lazily: merely having it installed must not make ``auto`` pick XLA on a
machine without a TPU, so the probe asks for ``PJRT_DEVICE`` or a TPU on the PCI bus first.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import threading
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..base import Backend
from ..collectives import Collectives, replica_threads
from ..collectives.xla_graph import XLACollectives, XLASingleReplicaCollectives, xla_model
from ..device import PeakTable, StepPatch, World, cpu_process_bound
from ..launchers.xla import XLALauncher, cpu_replicas_env

__all__ = ["XLABackend", "cpu_replicas_env", "install_hint", "sync_graph", "tpu_detected"]

log = logging.getLogger("xshard.backends")

#: PCI vendor id of Google, and the device ids of its TPU chips (v2/v3, v4, v5p, v5e, v6e, 7x),
#: as listed under /sys/bus/pci/devices/*/{vendor,device}. Google's other PCI devices (the gVNIC
#: network card of every GCE VM) share the vendor id, so the device id matters. A TPU generation
#: missing here still works with PJRT_DEVICE=TPU set.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
_PCI_DEVICES = Path("/sys/bus/pci/devices")


def tpu_accelerator_type() -> str:
    """The TPU VM's accelerator type as Cloud TPU sets it in ``TPU_ACCELERATOR_TYPE`` ("v4-8", "v5litepod-16",
    "v5p-8", "v6e-8"): the chip generation the throughput report looks its peak FLOPS up by; "tpu" when unset."""
    return os.environ.get("TPU_ACCELERATOR_TYPE", "") or "tpu"


#: Google's TPU generations, by the accelerator type ``tpu_accelerator_type`` reads (the xla and tpu backends')
TPU_PEAK_TFLOPS = PeakTable(
    {
        "TPU v4": {"bf16": (275.0, "Google Cloud TPU v4 documentation")},
        "TPU v5e": {"bf16": (197.0, "Google Cloud TPU v5e documentation")},
        "TPU v5p": {"bf16": (459.0, "Google Cloud TPU v5p documentation")},
        "TPU v6e": {"bf16": (918.0, "Google Cloud TPU v6e (Trillium) documentation")},
        "TPU v7": {"bf16": (2307.0, "half of Google's published 4614 FP8 TFLOPS per Ironwood chip")},
    },
    ((("v5litepod",), "TPU v5e"), (("v5e",), "TPU v5e"), (("v5p",), "TPU v5p"), (("v6e",), "TPU v6e"),
     (("v4",), "TPU v4"), (("tpu7",), "TPU v7"), (("v7",), "TPU v7")),
)


def tpu_chip_count(pci_devices: Path = _PCI_DEVICES) -> int:
    """How many Google TPU chips are on this machine's PCI bus (no torch_xla import, no runtime start)."""
    try:
        entries = list(pci_devices.iterdir())
    except OSError:
        return 0
    chips = 0
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text().strip().lower()
            if vendor == _GOOGLE_PCI_VENDOR and (entry / "device").read_text().strip().lower() in _TPU_PCI_DEVICES:
                chips += 1
        except OSError:
            continue
    return chips


def tpu_detected(pci_devices: Path = _PCI_DEVICES) -> bool:
    """Is a Google TPU chip on this machine's PCI bus? (No torch_xla import, no runtime start.)"""
    return tpu_chip_count(pci_devices) > 0


def host_device_count(env: Mapping[str, str] | None = None, pci_devices: Path | None = None) -> int | None:
    """How many processes torch_xla's launcher starts replicas for on this host, read from the
    environment and the PCI bus, never from the runtime (starting it in the launcher's process makes
    ``xmp.spawn`` refuse to run). XLA:CPU: ``CPU_NUM_DEVICES`` virtual devices (default 1); TPU: one
    per chip. None for other PJRT devices, which torch_xla counts itself."""
    env = os.environ if env is None else env
    device = env.get("PJRT_DEVICE", "").strip().upper()
    if device == "CPU":
        raw = env.get("CPU_NUM_DEVICES", "").strip()
        if not raw:
            return 1
        return int(raw) if raw.isdigit() and int(raw) > 0 else None
    if device in ("", "TPU"):
        return tpu_chip_count(_PCI_DEVICES if pci_devices is None else pci_devices) or None
    return None


def install_hint() -> str:
    """How to install a torch_xla that matches this torch (torch_xla pins torch's minor version)."""
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (
        f"pip install 'torch~={major_minor}.0' 'torch-xla~={major_minor}.0' (torch_xla needs the torch "
        f"minor version it was built for; if no torch-xla release matches torch {major_minor}, use a "
        "separate virtual environment with a matching pair, e.g. pip install torch==2.9.0 torch-xla==2.9.0)"
    )


def sync_graph() -> None:
    """Cut the traced graph and run it: ``torch_xla.sync()``, or ``xm.mark_step()`` before 2.6."""
    import torch_xla

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:
        xla_model().mark_step()


def _runtime() -> Any:
    return importlib.import_module("torch_xla.runtime")


class XLABackend(Backend):
    """TPUs through torch_xla (PJRT). One replica per device; no torch.distributed process group."""

    name = "xla"
    device_type = "xla"
    dist_backend = None
    # TPU_VISIBLE_CHIPS alone is not enough to carve a TPU VM into jobs: the runtime also needs
    # TPU_CHIPS_PER_PROCESS_BOUNDS and TPU_PROCESS_BOUNDS to agree with it (see the TPU docs).
    visible_devices_env = "TPU_VISIBLE_CHIPS"
    native_avg = False  # torch_xla's process group raises on ReduceOp.AVG: SUM then divide
    vendor_module = "torch_xla"
    #: XLA tensors have no storage to resize: the core replaces a freed full parameter's ``.data``
    frees_storage_by_resize: ClassVar[bool] = False
    #: the TPU generations (``device_name`` is the TPU VM's accelerator type)
    peak_tflops: ClassVar[PeakTable] = TPU_PEAK_TFLOPS
    trainer_device_count: ClassVar[int] = 0  # transformers' n_gpu on an XLA device
    #: the kernels library knows TorchTPU's device type "tpu", not torch_xla's "xla" ("Unsupported device type")
    runs_hub_kernels: ClassVar[bool] = False
    #: every new input shape is a new graph to compile
    compiles_graphs: ClassVar[bool] = True

    def __init__(self, world: World | None = None) -> None:
        # Reading the world starts the PJRT runtime, which must happen before the first backward
        # of the process: torch's autograd engine sizes its per-device queues then, and an XLA
        # backward after a CPU backward that ran before the runtime started fails inside it.
        super().__init__(world if world is not None else self.runtime_world())

    @staticmethod
    def runtime_world() -> World:
        """This replica's place in the job, from torch_xla's runtime (starts the runtime)."""
        xr = _runtime()
        return World(
            rank=int(xr.global_ordinal()),
            world_size=int(xr.world_size()),
            local_rank=int(xr.local_ordinal()),
            local_world_size=int(xr.local_device_count()),
        )

    # ------------------------------------------------------------------ probing
    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("torch_xla") is None:
            return f"torch_xla is not installed: {install_hint()}"
        if not os.environ.get("PJRT_DEVICE") and not tpu_detected():
            return (
                "torch_xla is installed but no XLA device is configured: PJRT_DEVICE is not set and no "
                "TPU was found on this machine; set PJRT_DEVICE=TPU on a TPU VM (PJRT_DEVICE=CPU runs "
                "XLA on this CPU, for testing)"
            )
        try:
            importlib.import_module("torch_xla")
        except (Exception, SystemExit) as exc:  # a torch/torch_xla mismatch fails with undefined symbols
            return (
                f"torch_xla {cls.vendor_version()} cannot be imported with torch {torch.__version__} "
                f"({type(exc).__name__}: {exc}): {install_hint()}"
            )
        return None

    @classmethod
    def auto_skip_reason(cls) -> str | None:
        """XLA on the CPU is a testing mode: ``auto`` takes XLA for a TPU (or another PJRT device) only.

        ``import torch_xla`` itself sets PJRT_DEVICE=CPU when nothing is set, so any library that
        imports it (the transformers Trainer does when torch_xla is installed) would otherwise make
        ``auto`` choose XLA:CPU on a plain or GPU machine.
        """
        if os.environ.get("PJRT_DEVICE", "").upper() == "CPU" and not tpu_detected():
            return (
                "PJRT_DEVICE=CPU runs XLA on the CPU, a testing mode that auto does not choose (torch_xla "
                "sets it by itself when imported): ask for it with XSHARD_BACKEND=xla"
            )
        return None

    @classmethod
    def vendor_version(cls) -> str | None:
        try:
            return importlib.metadata.version("torch-xla")
        except importlib.metadata.PackageNotFoundError:
            return None

    @classmethod
    def default_env(cls) -> dict[str, str]:
        """Nothing: transformers' and Accelerate's TPU code paths are this backend's (see ``Backend.default_env``)."""
        return {}

    @staticmethod
    def runtime_device_type() -> str:
        """The PJRT device kind the runtime drives: "TPU", "CPU", "CUDA", ..."""
        return str(_runtime().device_type())

    @classmethod
    def accelerate_distributed_type(cls) -> str:
        """Accelerate's name for a torch_xla job is XLA."""
        return "XLA"

    # ------------------------------------------------------------------ devices
    def device_count(self) -> int:
        return int(_runtime().addressable_device_count())

    def device_name(self) -> str:
        return tpu_accelerator_type()

    def max_processes_per_node(self) -> tuple[int, str]:
        """XLA:CPU: as many virtual devices as processes asked for (``CPU_NUM_DEVICES``), so the CPU's bound;
        a TPU: one process per chip."""
        if os.environ.get("PJRT_DEVICE", "").strip().upper() == "CPU":
            return cpu_process_bound()
        return super().max_processes_per_node()

    def host_device_count(self) -> int | None:
        """From the environment and the PCI bus (see ``host_device_count``): never the runtime."""
        return host_device_count()

    def device(self, local_rank: int | None = None) -> torch.device:
        """This replica's XLA device. ``local_rank`` is ignored: PJRT binds each replica to its device."""
        import torch_xla

        return torch_xla.device()

    def set_device(self, local_rank: int | None = None) -> None:
        """Nothing to do: the PJRT runtime binds each replica to its device when it starts."""

    def synchronize(self) -> None:
        """Wait until the device has finished every computation queued so far."""
        xla_model().wait_device_ops()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        xla_model().set_rng_state(int(seed), device=self.device())

    def rng_state(self) -> torch.Tensor | None:
        """The XLA generator's seed, as a one-element uint64 bit pattern stored in an int64 tensor."""
        seed = int(xla_model().get_rng_state(device=self.device()))
        return torch.tensor([seed if seed < 2**63 else seed - 2**64], dtype=torch.int64)

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            xla_model().set_rng_state(int(state.item()) % 2**64, device=self.device())

    def memory_stats(self) -> dict[str, int]:
        """Device bytes in use and at peak, where the PJRT client reports them (TPU, CUDA); else 0."""
        try:
            info = xla_model().get_memory_info(self.device())
        except (RuntimeError, NotImplementedError, AttributeError) as exc:  # XLA:CPU reports nothing
            log.debug("xla: no memory info from the runtime (%s)", exc)
            return {"allocated": 0, "peak": 0}
        used = int(info.get("bytes_used", 0))
        return {"allocated": used, "peak": int(info.get("peak_bytes_used", used))}

    def reset_peak_memory_stats(self) -> None:
        """The PJRT runtime has no peak reset; the peak is since the process started."""

    # ------------------------------------------------------------------ precision
    def supports(self, dtype: torch.dtype) -> bool:
        """fp32 and bf16 everywhere; fp16 not on TPUs (their matrix units compute in bf16)."""
        if dtype == torch.float16:
            return self.runtime_device_type() != "TPU"
        return dtype in (torch.float32, torch.bfloat16)

    def grad_scaler(self, enabled: bool = True, **settings: Any) -> Any:
        """fp16 loss scaling for XLA:GPU/CPU; refused on TPUs, which train in bf16 without scaling.

        torch_xla ships no GradScaler of its own (``torch_xla.amp`` 2.9 has ``autocast`` and the
        syncfree optimizers only), so this is torch's ``torch.amp.GradScaler("xla")``, whose
        unscale and scale update torch_xla implements as XLA ops.
        """
        if enabled and self.runtime_device_type() == "TPU":
            raise ValueError(
                "xla: fp16 with a gradient scaler is not supported on TPUs; use bf16 instead "
                "(TPUs compute in bf16 natively and need no loss scaling)"
            )
        return super().grad_scaler(enabled, **settings)

    # ------------------------------------------------------------------ distributed
    def local_collectives(self) -> Collectives:
        return XLASingleReplicaCollectives()

    def _make_collectives(self) -> Collectives:
        if self.world.world_size == 1:
            return self.local_collectives()
        # XLA:CPU replicas are threads that compile their own copies of each graph (see
        # XLACollectives.channel_ids); TPU replicas keep torch_xla's defaults (pinned layouts).
        threads = self.world.world_size if self._replicas_are_threads() else 1
        if threads > 1:
            use_host_rendezvous()
        return XLACollectives(self.world.rank, self.world.world_size,
                              channel_ids=self.runtime_device_type() == "CPU", process_replicas=threads)

    def _subgroup_collectives(self, groups: tuple[tuple[int, ...], ...], mine: tuple[int, ...]) -> Collectives:
        """Collectives within ``mine``: torch_xla's replica groups (``groups=`` on every collective)."""
        threads = self.world.world_size if self._replicas_are_threads() else 1
        return XLACollectives(mine.index(self.world.rank), len(mine), channel_ids=self.runtime_device_type() == "CPU",
                              groups=[list(g) for g in groups], process_replicas=threads)

    # ------------------------------------------------------------------ training hooks
    def mark_step(self) -> None:
        """Cut the traced graph here and run it (torch_xla.sync, or xm.mark_step on older torch_xla).

        XLA:CPU replicas (threads of one process) first meet at a host-side barrier, so that they
        compile the new graph together (see ``replica_threads``).
        """
        if self.world.world_size > 1 and self._replicas_are_threads():
            replica_threads.align(self.world.world_size)
        sync_graph()

    def optimization_barrier(self, tensors: list[torch.Tensor]) -> None:
        """``xm.optimization_barrier_`` (in place): the sharded core fences each unit's gathers and
        reduce-scatters with it, as torch_xla's FSDP does, so that the compiler can neither gather a
        unit before the previous unit's output exists nor merge a forward gather with the backward's
        (either would keep several units' full parameters alive at once)."""
        if tensors:
            xla_model().optimization_barrier_(list(tensors))

    def _replicas_are_threads(self) -> bool:
        """Are this job's replicas threads of one process? (XLA:CPU: one thread per virtual device.)"""
        threads = getattr(self, "_threads", None)
        if threads is None:
            threads = self._threads = self.runtime_device_type() == "CPU" and self.device_count() > 1
        return threads

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` then ``mark_step``; never xm.optimizer_step's gradient all-reduce."""
        optimizer.step()
        self.mark_step()

    def checkpoint_wrapper(self, module: torch.nn.Module) -> torch.nn.Module:
        """Recompute ``module``'s activations in backward with torch_xla's checkpoint (in place).

        torch_xla's checkpoint puts optimization barriers around the recompute, so the compiler
        cannot merge it with the forward (which would keep the activations alive after all). It
        is reentrant only: a call none of whose inputs requires grad would produce no parameter
        gradients, and torch_xla's own ``checkpoint_module`` then silently skips checkpointing
        (a first block fed with data, a block after frozen layers: the memory saving vanishes).
        Here such a call gets an extra input that requires grad and is otherwise ignored, so it
        is checkpointed like the others. The module's forward is replaced in place: parameter
        names and state-dict keys do not change.
        """
        if getattr(module, "_xshard_checkpointed", False):
            return module
        from torch_xla.utils.checkpoint import checkpoint

        inner = module.forward

        def run_inner(m: torch.nn.Module, n_args: int, n_kwargs: int, n_anchors: int, *packed: Any) -> Any:
            # a bound method of the module, so that torch_xla puts its parameters behind the barrier
            packed = packed[n_anchors:]
            args, names, values = packed[:n_args], packed[n_args:n_args + n_kwargs], packed[n_args + n_kwargs:]
            return inner(*args, **dict(zip(names, values, strict=True)))

        # torch's stubs type Module.__setattr__ as taking a Tensor or a Module only
        module._xshard_checkpointed_call = types.MethodType(run_inner, module)  # type: ignore[assignment]

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            # torch_xla's checkpoint takes positional arguments only: pack the keywords after them
            packed = (*args, *kwargs.keys(), *kwargs.values())
            needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in packed)
            anchors = () if needs_grad else (torch.zeros((), device=self.device(), requires_grad=True),)
            return checkpoint(module._xshard_checkpointed_call, len(args), len(kwargs), len(anchors),
                              *anchors, *packed)

        module.forward = forward
        # torch's stubs type Module.__setattr__ as taking a Tensor or a Module only
        module._xshard_checkpointed = True  # type: ignore[assignment]
        return module

    def wrap_dataloader(self, loader: Any) -> Any:
        """torch_xla's MpDeviceLoader: batches are moved to the device in the background.

        Not for replicas that are threads of one process (XLA:CPU, a testing mode): the loader's
        background threads (loading, transfers, and a graph cut per batch, one set per replica) run
        beside the replica threads in one process, and a replica held up there reaches the step's
        first collective late, past XLA:CPU's fixed 10 s. The prepared loader moves each batch to the
        device itself, and the step's graph is cut at the optimizer step.
        """
        if self.world.world_size > 1 and self._replicas_are_threads():
            return loader
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        return MpDeviceLoader(loader, self.device())

    def launcher(self) -> XLALauncher:
        """torch_xla's own launcher, one process per local chip (see ``launchers/xla.py``)."""
        return XLALauncher(self)

    def optimizer_step_patch(self) -> OptimizerStepPatch:
        """Make ``xm.optimizer_step`` a plain step while a sharded model is active (undo: ``restore``)."""
        return OptimizerStepPatch()

    # ------------------------------------------------------------------ reporting
    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["pjrt_device"] = os.environ.get("PJRT_DEVICE")
        try:
            facts["runtime_device_type"] = self.runtime_device_type()
        except Exception as exc:  # a report must not crash on a half-working runtime
            facts["runtime_device_type"] = f"unknown ({type(exc).__name__}: {exc})"
        return facts


_rendezvous_lock = threading.Lock()


def use_host_rendezvous() -> None:
    """Replace ``xm.rendezvous`` (and so ``xm.mesh_reduce``) for the rest of this process, whose
    replicas are threads (XLA:CPU): the payloads are exchanged on the host (``replica_threads.exchange``).

    torch_xla's rendezvous all-gathers the payloads with collectives that carry no channel id, and
    XLA:CPU matches those between replica threads by an id that differs between copies of a graph
    compiled apart: the replicas wait for each other until XLA ends the process. The transformers
    Trainer meets it at its first logging step (``nested_gather`` is ``xm.mesh_reduce`` on XLA) and
    at saves (``xm.rendezvous``); scripts written for torch_xla use ``xm.mesh_reduce`` for metrics.
    Same contract: the pending graph is run first, and the result lists every replica's payload in
    ordinal order. Code that did ``from torch_xla.core.xla_model import rendezvous`` keeps the original.
    """
    xm = xla_model()
    with _rendezvous_lock:
        if getattr(xm.rendezvous, "__xshard_host__", False):
            return
        original = xm.rendezvous

        @functools.wraps(original)
        def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
            xr = _runtime()
            world_size = int(xr.world_size())
            if replicas and sorted(replicas) != list(range(world_size)):
                raise ValueError(f"xm.rendezvous({tag!r}): only a rendezvous of every replica is supported, "
                                 f"got replicas={replicas}")
            if not isinstance(payload, bytes):
                raise TypeError(f"xm.rendezvous({tag!r}): payload must be bytes, not {type(payload).__name__}")
            replica_threads.align(world_size)
            sync_graph()
            return replica_threads.exchange(world_size, int(xr.global_ordinal()), payload)

        rendezvous.__xshard_host__ = True  # type: ignore[attr-defined]
        xm.rendezvous = rendezvous
    log.info("xla: xm.rendezvous and xm.mesh_reduce exchange their payloads between the replica threads on the "
             "host (XLA:CPU cannot match their collectives between replicas)")


class OptimizerStepPatch(StepPatch):
    """``xm.optimizer_step`` replaced by ``optimizer.step(**optimizer_args)`` then a graph sync.

    Scripts written for torch_xla's data parallelism call ``xm.optimizer_step(optimizer)``, which
    all-reduces every gradient first. Under the sharded core the gradients are already reduced
    (and sharded), so that all-reduce would be wrong and wasteful. The replacement always ends
    the graph (whatever ``barrier`` says), so that one training step is one graph even in a loop
    without MpDeviceLoader, whose batches would otherwise cut it. Same idea as the Hugging Face
    Trainer's XLA FSDP path (``optimizer.step()`` then ``mark_step``), but scoped: ``restore()`` (or leaving the ``with`` block) puts the
    original function back. Code that did ``from torch_xla.core.xla_model import optimizer_step``
    before the patch keeps the original.

    The patch is process-wide and counted: replicas that are threads of one process (XLA:CPU,
    TPU v2/v3 cores) each apply and restore it, and the original comes back with the last restore.
    """

    _lock = threading.Lock()
    _holders = 0
    _original: Callable[..., Any] | None = None
    _replacement: Callable[..., Any] | None = None
    _announced = False  # log the first patched call once per process

    def __init__(self) -> None:
        super().__init__()
        with OptimizerStepPatch._lock:
            xm = xla_model()
            if OptimizerStepPatch._holders == 0:
                original = xm.optimizer_step

                @functools.wraps(original)
                def optimizer_step(
                    optimizer: torch.optim.Optimizer,
                    barrier: bool = False,
                    optimizer_args: dict | None = None,
                    groups: Any = None,
                    pin_layout: bool = True,
                ) -> Any:
                    return _step_without_reduce(optimizer, optimizer_args)

                OptimizerStepPatch._original = original
                OptimizerStepPatch._replacement = optimizer_step
                xm.optimizer_step = optimizer_step
            OptimizerStepPatch._holders += 1
            self.original = OptimizerStepPatch._original
            self.replacement = OptimizerStepPatch._replacement

    def restore(self) -> None:
        """Release this patch; the last release puts the original back (idempotent)."""
        with OptimizerStepPatch._lock:
            if not self.active:
                return
            self.active = False
            OptimizerStepPatch._holders -= 1
            if OptimizerStepPatch._holders > 0:
                return
            xm = xla_model()
            if xm.optimizer_step is self.replacement:
                xm.optimizer_step = self.original
            else:
                log.warning(
                    "xm.optimizer_step was replaced again after xshard patched it; leaving the newer "
                    "replacement in place (undo patches in the reverse order of applying them)"
                )


def _step_without_reduce(optimizer: torch.optim.Optimizer, optimizer_args: dict | None) -> Any:
    """The body of the patched ``xm.optimizer_step``: step, then sync the graph."""
    if not OptimizerStepPatch._announced:
        OptimizerStepPatch._announced = True
        log.info(
            "xm.optimizer_step: stepping without its gradient all-reduce, because the sharded "
            "model already reduced the gradients"
        )
    loss = optimizer.step(**(optimizer_args or {}))
    sync_graph()
    return loss
