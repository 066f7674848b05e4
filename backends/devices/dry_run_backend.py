"""The dry run's backend: ONE rank of a job of any size, on this host's CPU, over torch's fake process group.

`xshard launch --dry-run --nnodes 128 --nproc 8 train.py` runs the script once, as rank 0 (or
``--dry_run_rank``) of 1,024, through ``python -m xshard.cli.dry_run``, which registers this backend as
``dry_run`` in that process. Torch's fake process group (``torch.testing._internal.distributed.fake_pg``)
answers every collective at once without moving data: an all-gather fills each rank's slot with this
rank's input, a reduction leaves the input as it is. So everything that depends on the world's size is
real (the shard geometry and its padding, the units, hybrid groups, the bytes of every collective, the
state each rank holds) and no value is (the losses, the weights after a step).

The collectives take the device libraries' own forms (NCCL and HCCL reduce-scatter and all-gather
natively, average natively), not the gloo workarounds of the cpu backend, so the calls and bytes
counted are those of the cluster's job. The hang diagnosis is off: no peer exists to wait for.

What the run sets (``xshard.cli.dry_run``): ``dry_run_settings.py``, read through ``dry_run()``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .. import DRY_RUN
from .cpu import CPUBackend
from .dry_run_settings import DryRunSettings


class DryRunBackend(CPUBackend):
    """One rank of a job of ``WORLD_SIZE`` ranks on this host's CPU, over torch's fake process group."""

    name = DRY_RUN
    dist_backend = "fake"
    native_avg = True  # as NCCL and HCCL: one average, no divide after a sum

    def dry_run(self) -> DryRunSettings | None:
        """The dry run's settings (``dry_run_settings.py``), from the environment its launcher set."""
        return DryRunSettings.from_env()

    def max_processes_per_node(self) -> tuple[int, str]:
        """Any count: a dry run starts one process, whatever ``--nproc`` says."""
        return 1 << 20, "a dry run starts one process"

    def process_group_options(self) -> dict[str, Any]:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

        return {"store": dist.HashStore()}  # no rendezvous: no other rank will come

    def collective_options(self) -> dict[str, Any]:
        return {}  # the native forms, as on the cluster (not the cpu backend's gloo forms)


def register() -> None:
    """Make ``XSHARD_BACKEND=dry_run`` selectable in this process (idempotent)."""
    from .. import names, register_backend

    if DRY_RUN not in names():
        register_backend(DRY_RUN, f"{__name__}:DryRunBackend")
