"""TPU backend on TorchTPU (``torch_tpu``): an eager ``tpu`` device with torch.distributed collectives.

The same core as cuda and npu: eager tensors on the device, a c10d process group, one process per
chip started by torchrun. Facts that shape this class, read from the torch-tpu 0.2.0 wheel's Python
sources (tests/test_vendor_conformance_tpu.py holds them to the wheel):

- ``import torch_tpu`` (or torch's auto-loading of its ``torch.backends`` entry point
  ``torch_tpu._loader:load``) renames PrivateUse1 to ``tpu``, registers ``torch.tpu`` and the
  process-group backends ``"tpu"`` and ``"tpu_dist"`` (one constructor), but only when it finds a TPU
  on the PCI bus. With ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` importing it does not load it: the probe
  then calls that same entry point.
- On torch >= 2.11 the ``torch.tpu`` device functions that have a ``torch.accelerator`` twin
  (``device_count``, ``set_device``, ``current_device``, ``synchronize``, ``is_available``; on
  torch >= 2.13 ``get_rng_state``) are internal: called from outside torch and torch_tpu they raise
  RuntimeError. So this class asks ``torch.accelerator`` (whose memory statistics TorchTPU's allocator
  serves) and reads the RNG state from ``torch.tpu.default_generators``.
- TorchTPU binds each process to its own chip when its runtime starts (``set_device`` to another
  index raises): binding here means learning that index.
- Several processes need ``torch.tpu.distributed.set_tpu_launch_env()`` in the launching process
  before any worker starts (slice-builder addresses and topology every rank must agree on); the
  launcher (``launchers/tpu.py``) puts what it sets into the plan, then runs torchrun.
- Starting the runtime claims the chips of the process that does it, so the launcher counts chips on
  the PCI bus (``xla.tpu_chip_count``), never through the runtime.
- The process group's reductions: xshard sends SUM (then divides) for averages, MAX and MIN. TorchTPU's
  own code forwards ``ReduceOp.AVG`` to it, but its lowering is C++ that only a TPU can confirm, and
  SUM is what every collective library implements (``native_avg = False``, as for gloo and XLA).
- Eager ops run as XLA programs that TorchTPU compiles once per shape and caches (its "compilation cache
  for XLA computations"; ``torch.compile`` on a TPU defaults to ``dynamic=False``), so a new batch width is
  new compilations: ``compiles_graphs`` lets the data path pad batches to a few static widths, as on XLA.
- Its tensors have storage its hooks can resize (``TpuHooksInterface::resizePrivateUse1Bytes`` in the
  glue library), so gathered parameters are freed by resizing as on cuda and npu (the default).
- TorchTPU ships no GradScaler; TPUs compute in bf16 natively and need no loss scaling, so fp16 is
  refused with bf16 named instead, as the xla backend does on a TPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ...errors import BackendUnavailableError
from ..base import Backend, World
from .vendor import AUTOLOAD_ENV, import_vendor, torch_release
from .xla import TPU_PEAK_TFLOPS

if TYPE_CHECKING:
    from ..launchers import Launcher

T = TypeVar("T")

#: the entry point torch's auto-loading calls (torch-tpu's entry_points.txt, group torch.backends)
LOAD_ENTRY_POINT = "torch_tpu._loader:load"
#: the torch releases torch-tpu 0.2.0 is built for (its METADATA: torch>=2.11.0,<=2.15.0)
TORCH_RANGE = "2.11 to 2.15"
_INSTALL = f"pip install torch-tpu (on a TPU VM; it needs libtpu and torch {TORCH_RANGE})"


def _quietly(call: Callable[[], T]) -> T:
    """``call()`` without TorchTPU's once-per-process "experimental API" warning (the APIs used here
    are the ones its documentation points to; the warning would only reach the user's log)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return call()


class TPUBackend(Backend):
    """Google TPUs through TorchTPU: one process per chip, the "tpu" c10d process group."""

    name = "tpu"
    device_type = "tpu"
    compiles_graphs = True  # see the module docstring: keep batch shapes static
    peak_tflops = TPU_PEAK_TFLOPS  # the same chips as the xla backend's, by the same accelerator type
    dist_backend = "tpu"  # torch_tpu registers "tpu" and "tpu_dist" with the same constructor
    visible_devices_env = None  # TorchTPU binds each process to its chip; no device list to choose from
    native_avg = False  # see the module docstring: SUM then divide
    vendor_module = "torch_tpu"
    install_hint = _INSTALL
    related_env_vars = ("TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TPU_WORKER_HOSTNAMES",
                        "TPU_VISIBLE_CHIPS", AUTOLOAD_ENV)

    def __init__(self, world: World | None = None) -> None:
        super().__init__(world)
        why_not = self.unavailable_reason()
        if why_not is not None:
            raise BackendUnavailableError(f"tpu: {why_not}")
        self._index: int | None = None

    # ------------------------------------------------------------------ probing
    @classmethod
    def unavailable_reason(cls) -> str | None:
        imported = import_vendor("torch_tpu")
        if imported.missing:
            return f"torch_tpu is not installed: {_INSTALL}"
        if not imported.ok:
            return (f"torch_tpu is installed but cannot load ({imported.error}): install libtpu "
                    f"(pip install libtpu) and a torch release torch-tpu supports ({TORCH_RANGE}; this is "
                    f"{torch_release()})")
        if not hasattr(torch, "tpu"):
            _load_entry_point()
        if not hasattr(torch, "tpu"):
            return ("torch_tpu loaded but registered no tpu device: it does so only where it finds a TPU chip "
                    "on the PCI bus (exposed through /dev/vfio); on a TPU VM check that no other process holds "
                    "the chips, elsewhere choose another backend")
        return None

    @classmethod
    def vendor_version(cls) -> str | None:
        if sys.modules.get("torch_tpu") is None:
            return None
        try:
            return importlib.metadata.version("torch-tpu")
        except importlib.metadata.PackageNotFoundError:
            return None

    @classmethod
    def runtime_initialized(cls) -> bool:
        # Never imports torch_tpu: if it is not imported, its runtime cannot have started.
        if sys.modules.get("torch_tpu") is None or not hasattr(torch, "tpu"):
            return False
        return bool(_quietly(torch.tpu.is_initialized))

    # ------------------------------------------------------------------ devices
    def host_device_count(self) -> int | None:
        """TPU chips on this host's PCI bus: starting the runtime here would claim the chips."""
        from .xla import tpu_chip_count

        return tpu_chip_count() or None

    def device_count(self) -> int:
        return int(torch.accelerator.device_count())

    def device_name(self) -> str:
        from .xla import tpu_accelerator_type

        return tpu_accelerator_type()

    def device(self, local_rank: int | None = None) -> torch.device:
        """This process's chip: the index TorchTPU bound it to once known (``set_device``), else
        ``torch.device("tpu")``, which means the same chip. ``local_rank`` is not an index here."""
        return torch.device(self.device_type, self._index) if self._index is not None else torch.device(self.device_type)

    def set_device(self, local_rank: int | None = None) -> None:
        """Learn the chip TorchTPU bound this process to (it refuses to switch chips)."""
        if self.device_count() < 1:
            raise BackendUnavailableError(
                f"tpu: rank {self.world.rank} sees no TPU chip: start one process per chip "
                "(xshard launch counts them) and check that no other process holds the chips")
        self._index = int(torch.accelerator.current_device_index())

    def synchronize(self) -> None:
        torch.accelerator.synchronize()

    def rng_state(self) -> torch.Tensor | None:
        return self._generator().get_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self._generator().set_state(state)

    def _generator(self) -> torch.Generator:
        index = self._index if self._index is not None else int(torch.accelerator.current_device_index())
        return _quietly(lambda: torch.tpu.default_generators[index])  # type: ignore[attr-defined]  # torch_tpu's

    def memory_stats(self) -> dict[str, int]:
        return {"allocated": int(torch.accelerator.memory_allocated()),
                "peak": int(torch.accelerator.max_memory_allocated())}

    def reset_peak_memory_stats(self) -> None:
        torch.accelerator.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        """Nothing: the function would be ``torch.tpu``'s, which TorchTPU may keep internal (see the module docstring)."""

    # ------------------------------------------------------------------ precision
    def supports(self, dtype: torch.dtype) -> bool:
        """fp32 and bf16 (the matrix units compute in bf16); fp16 is not a TPU's training precision."""
        return dtype in (torch.float32, torch.bfloat16)

    def grad_scaler(self, enabled: bool = True, **settings: Any) -> Any:
        """A disabled ``torch.amp.GradScaler("tpu")``; an enabled one is refused (see the module docstring)."""
        if enabled:
            raise ValueError("tpu: fp16 with a gradient scaler is not supported on TPUs; use bf16 instead "
                             "(TPUs compute in bf16 natively and need no loss scaling; torch_tpu ships no GradScaler)")
        return super().grad_scaler(enabled, **settings)

    # ------------------------------------------------------------------ launching
    def launcher(self) -> Launcher:
        """torchrun, after TorchTPU's launch environment is set in the launching process."""
        from ..launchers.tpu import TPULauncher

        return TPULauncher(self)


def _load_entry_point() -> None:
    """Call torch_tpu's ``torch.backends`` entry point, as torch's auto-loading does (it registers
    torch.tpu where a TPU is found, and does nothing more when it already ran)."""
    module, _, attr = LOAD_ENTRY_POINT.partition(":")
    try:
        getattr(importlib.import_module(module), attr)()
    except Exception:  # a probe never raises: the caller reports the missing torch.tpu
        pass
