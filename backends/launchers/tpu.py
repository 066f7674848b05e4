"""TorchTPU's launch: torchrun, one process per chip, after TorchTPU's launch environment is set.

TorchTPU needs ``torch.tpu.distributed.set_tpu_launch_env(nnodes=, nproc_per_node=)`` called once in
the launching process before any worker starts: it decides the variables every rank must agree on
(``TORCH_TPU_SLICEBUILDER_ADDRESSES``, ``TORCH_TPU_TOPOLOGY``, ``TORCH_TPU_XPROF_SESSION_ID``; on
several hosts also ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` from
``TPU_WORKER_HOSTNAMES``), never overriding one the user set, and starts no runtime. Then torchrun
starts the workers, each inheriting them. Everything else is torchrun's (``TorchrunLauncher``).
"""

from __future__ import annotations

import os

import torch

from .base import LaunchError, LaunchPlan, LaunchRequest
from .torchrun import TorchrunLauncher


class TPULauncher(TorchrunLauncher):
    """torchrun with TorchTPU's launch environment (one process per chip by default)."""

    name = "torchrun (TorchTPU)"

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        if request.nproc is None:
            raise LaunchError("tpu: no TPU chip was found on this host's PCI bus to count processes by: "
                              "give --nproc (one per chip)")
        plan = super().plan(request)
        plan.env.update(tpu_launch_env(request.nnodes, request.nproc))  # shown in the plan's log line
        return plan


def tpu_launch_env(nnodes: int, nproc_per_node: int) -> dict[str, str]:
    """What ``set_tpu_launch_env`` would set for this job, without leaving it in this process's
    environment (it writes ``os.environ``; the plan carries the values to the workers instead)."""
    before = dict(os.environ)
    try:
        torch.tpu.distributed.set_tpu_launch_env(  # type: ignore[attr-defined]  # torch.tpu: added by torch_tpu
            nnodes=nnodes, nproc_per_node=nproc_per_node)
        return {k: v for k, v in os.environ.items() if before.get(k) != v}
    except ValueError as exc:  # its messages name the variable and the value it expected
        raise LaunchError(f"tpu: TorchTPU cannot set up this launch: {exc}") from exc
    finally:
        os.environ.clear()
        os.environ.update(before)
