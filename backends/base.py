"""The Backend: the few facts and operations that differ per device family.

Everything device-specific that the sharded core and the user API need goes through one of these
objects; nothing outside ``backends/`` names a device family. A Backend knows nothing of sharding.

The contract is split by role, each in its own module with a default for every member:

- ``DeviceAPI`` (device.py): device, RNG, memory, dtypes, autocast, grad scaler, per-step hooks,
  and the capabilities ``frees_storage_by_resize``, ``allocator_caches`` and ``compiles_graphs``;
- ``CommunicationAPI`` (communication.py): process group, ``collectives``, ``local_collectives()``;
- ``Launcher`` (launchers/): how `xshard launch` starts the processes, from ``Backend.launcher()``.

``Backend`` joins the first two and adds identity and probing. A subclass states its identity as
class attributes and overrides only what differs from the defaults (cpu, cuda and npu share almost
all of them). backends/README.md is the written contract, with how to add a backend.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .cluster import detect
from .collectives import Collectives
from .communication import CommunicationAPI
from .device import DeviceAPI, StepPatch
from .devices.dry_run_settings import DryRunSettings
from .environment import env_override
from .world import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, World

if TYPE_CHECKING:
    from .launchers import Launcher

log = logging.getLogger("xshard.backends")

__all__ = ["DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "Backend", "StepPatch", "World", "env_override"]


class Backend(DeviceAPI, CommunicationAPI):
    """One device family: identity and probing here; the device and communication roles mixed in.

    Instances are cheap; vendor modules are imported lazily (a broken vendor install must not break
    ``import xshard``: probes catch its failure and report the cause, see ``vendor.import_vendor``).
    """

    #: registry name, the value of XSHARD_BACKEND that selects it
    name: ClassVar[str] = ""
    #: environment variable that restricts which devices the vendor runtime sees
    visible_devices_env: ClassVar[str | None] = None
    #: vendor package the backend needs, with how to install it (for error messages and `xshard env`)
    vendor_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""
    #: other environment variables that change how this backend behaves (shown by `xshard env`)
    related_env_vars: ClassVar[tuple[str, ...]] = ()

    def __init__(self, world: World | None = None) -> None:
        self.world = world if world is not None else detect()
        self._collectives: Collectives | None = None
        self._owns_process_group = False
        self._subgroups = {}

    # ------------------------------------------------------------------ probing
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (what is missing and how to get it), or None if it can.

        Must have no side effects beyond importing the vendor module.
        """
        raise NotImplementedError(f"{cls.__name__} must define unavailable_reason() (see backends/README.md)")

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
        (the launcher puts them into the environment of the processes it starts).

        By default ``USE_TORCH_XLA=0`` where torch_xla is installed (the xla backend sets nothing).
        transformers (and Accelerate) take their TPU code paths whenever torch_xla can be imported,
        whatever device the job runs on: the Trainer's ``parallel_mode`` is TPU and its logged loss is
        "gathered" with ``xm.mesh_reduce``, which on processes of another backend gathers nothing
        (rank 0's loss alone). The variable is read when transformers is imported, so only a launcher
        can set it in time.
        """
        if importlib.util.find_spec("torch_xla") is not None:
            return {"USE_TORCH_XLA": "0"}
        return {}

    @classmethod
    def apply_default_env(cls, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Put ``default_env()`` into ``env`` (default: os.environ), never overriding the user's
        values; returns and logs what it set."""
        env = os.environ if env is None else env
        added = {k: v for k, v in cls.default_env().items() if k not in env}
        for key, value in added.items():
            env[key] = value
            log.info("%s: set %s=%s (it was unset; export it yourself to choose another value)", cls.name, key, value)
        return added

    # ------------------------------------------------------------------ launching
    def dry_run(self) -> DryRunSettings | None:
        """What a dry run asks of this job (its report, steps, the target's memory: ``devices/dry_run_settings.py``);
        None for a real job. Only the dry run's backend (``devices/dry_run_backend.py``) answers."""
        return None

    def launcher(self) -> Launcher:
        """How `xshard launch` starts this backend's processes (default: torchrun, one per device)."""
        from .launchers.torchrun import TorchrunLauncher

        return TorchrunLauncher(self)

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
