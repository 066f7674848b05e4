"""One training step per framework, behind one small interface, for ``sharding_vs_peers.py``.

Every configuration trains the same model on the same batch with ``torch.optim.AdamW`` in fp32.
A step is ``zero_grad(); forward_backward(); optimizer_step()``; the memory probe runs between
``forward_backward`` and ``optimizer_step`` (the peak of model state).

Frameworks are imported only by the configuration that uses them, after the collective counter is
installed (see ``comm_count``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from mlp import loss_fn

#: configuration name -> what it runs
CONFIGS: dict[str, str] = {
    "limit": "1 process, one rank's batch share, AdamW on 1/world of the parameters, no communication",
    "limit-fullopt": "1 process, one rank's batch share, AdamW on all parameters, no communication",
    "ddp": "torch DistributedDataParallel (gradient_as_bucket_view=True, 25 MB buckets)",
    "fsdp2": "torch fully_shard per block, then the root (FULL_SHARD)",
    "ds-zero2": "DeepSpeed ZeRO-2 (CPU accelerator, gloo), defaults",
    "ds-zero3": "DeepSpeed ZeRO-3 (CPU accelerator, gloo), defaults",
    "xshard-0": "xshard stage 0 (NO_SHARD)",
    "xshard-2": "xshard stage 2 (SHARD_GRAD_OP)",
    "xshard-3": "xshard stage 3 (FULL_SHARD)",
    "fsdp2-hsdp": "torch fully_shard on a 2-D mesh (nodes x ranks per node): HSDP, sharded within a node",
    "xshard-hsdp-2": "xshard stage 2 sharded within each node, replicated across nodes (_HYBRID_SHARD_ZERO2)",
    "xshard-hsdp-3": "xshard stage 3 sharded within each node, replicated across nodes (HYBRID_SHARD)",
}

#: bytes per step in units of the fp32 parameter bytes (psi), in the ZeRO paper's convention
THEORY_PSI = {"ddp": 2, "fsdp2": 3, "ds-zero2": 2, "ds-zero3": 3, "xshard-0": 2, "xshard-2": 2, "xshard-3": 3}


@dataclass
class Trainer:
    """A configured training step. ``own_comm`` / ``own_state``: the framework's own counters, if any."""

    zero_grad: Callable[[], None]
    forward_backward: Callable[[], None]
    optimizer_step: Callable[[], None]
    reset_own_comm: Callable[[], None] = lambda: None
    own_comm: Callable[[], dict[str, Any] | None] = lambda: None
    own_state: Callable[[], dict[str, Any] | None] = lambda: None
    comm_seen_from_python: bool = True
    notes: list[str] = field(default_factory=list)


def is_distributed(name: str) -> bool:
    """Limits run in one process; everything else on the world."""
    return not name.startswith("limit")


def build(name: str, model: torch.nn.Module, batch: torch.Tensor, world_size: int,
          xshard_options: dict[str, Any] | None = None, nodes: int = 2) -> Trainer:
    """The trainer for configuration ``name`` (a key of CONFIGS); ``xshard_options`` go to ShardingOptions.

    ``nodes``: the simulated nodes of the hybrid configurations (``*-hsdp*``): ranks are split into
    ``nodes`` groups of ``world_size / nodes`` consecutive ranks, sharded within a group and
    replicated across groups (all on this machine: the "network" between nodes is loopback too).
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; valid: {', '.join(CONFIGS)}")
    if name.startswith("limit"):
        return _limit(model, batch, world_size if name == "limit" else 1)
    if name == "ddp":
        return _ddp(model, batch)
    if name in ("fsdp2", "fsdp2-hsdp"):
        return _fsdp2(model, batch, nodes if name == "fsdp2-hsdp" else 1, world_size)
    if name.startswith("ds-zero"):
        return _deepspeed(model, batch, int(name[-1]), world_size)
    options = dict(xshard_options or {})
    if "-hsdp-" in name:
        options.setdefault("shard_group_size", world_size // nodes)
    return _xshard(model, batch, int(name[-1]), options)


def _plain(module: torch.nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> Trainer:
    def forward_backward() -> None:
        loss_fn(module(batch)).backward()

    return Trainer(lambda: optimizer.zero_grad(set_to_none=True), forward_backward, optimizer.step)


def _limit(model: torch.nn.Module, batch: torch.Tensor, optimizer_share: int) -> Trainer:
    """Compute only: the model's forward/backward on one rank's batch, AdamW on 1/share of the parameters."""
    if optimizer_share == 1:
        return _plain(model, batch, torch.optim.AdamW(model.parameters()))
    numel = sum(p.numel() for p in model.parameters())
    shard = torch.nn.Parameter(torch.zeros(numel // optimizer_share))
    shard.grad = torch.randn_like(shard)
    optimizer = torch.optim.AdamW([shard])
    trainer = _plain(model, batch, optimizer)
    trainer.zero_grad = lambda: model.zero_grad(set_to_none=True)
    return trainer


def _ddp(model: torch.nn.Module, batch: torch.Tensor) -> Trainer:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    trainer = _plain(ddp, batch, torch.optim.AdamW(ddp.parameters()))
    trainer.comm_seen_from_python = False  # the reducer all-reduces from C++
    return trainer


def _fsdp2(model: torch.nn.Module, batch: torch.Tensor, nodes: int = 1, world_size: int = 1) -> Trainer:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = None
    if nodes > 1:  # HSDP: (replicate, shard) mesh, sharded within each node's consecutive ranks
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (nodes, world_size // nodes), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _plain(model, batch, torch.optim.AdamW(model.parameters()))


def _deepspeed(model: torch.nn.Module, batch: torch.Tensor, stage: int, world_size: int) -> Trainer:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": batch.shape[0],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW, the optimizer every configuration uses
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                      config=config)

    def forward_backward() -> None:
        engine.backward(loss_fn(engine(batch)))

    # engine.step() zeroes the gradients itself
    return Trainer(lambda: None, forward_backward, engine.step)


def _xshard(model: torch.nn.Module, batch: torch.Tensor, stage: int, options: dict[str, Any]) -> Trainer:
    from xshard.backends.devices.cpu import CPUBackend
    from xshard.sharding import ShardingOptions, shard_model

    backend = CPUBackend()
    backend.init_process_group()
    sharded = shard_model(model, backend, ShardingOptions(stage=stage, **options))
    optimizer = torch.optim.AdamW(sharded.parameters())
    sharded.register_optimizer(optimizer)
    trainer = _plain(sharded, batch, optimizer)
    trainer.reset_own_comm = sharded.reset_stats
    trainer.own_comm = lambda: sharded.stats()["comm"]
    trainer.own_state = lambda: sharded.stats()["state_bytes"]
    return trainer
