"""Training runs shared by the XLA core tests: the core on XLA (one or more replicas), the same
model on the CPU backend, and torch_xla's own XlaFullyShardedDataParallel.

Every run trains ``TinyLM`` (tied head, a 0-dim parameter, sizes that need padding) with AdamW for
``steps`` steps on the global batches of ``models.batch``; a replica trains on its slice of each
batch, so the mean of the replicas' losses is the full-batch loss. Runs return per-step losses, each
step's gradient squares (``gradient_squares``: what a wrong average changes while AdamW's losses and
weights hardly move) and the full state dict on the CPU (rank 0), plus XLA facts (compile counts,
collectives).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from support.models import Block, batch, make_tiny

GLOBAL_BATCH = 4
LR = 1e-2
_build_lock = threading.Lock()  # XLA:CPU replicas are threads sharing torch's global RNG


def build_tiny(device: torch.device | str = "cpu", checkpoint_probe: bool = False) -> torch.nn.Module:
    """TinyLM seeded identically on every replica, moved to ``device`` with its head tied again.

    ``checkpoint_probe`` counts the forward calls of each block's ``up`` layer in ``model.up_calls``
    (a module inside a unit: a checkpointed unit runs it again in backward).
    """
    with _build_lock:
        model = make_tiny()
    model = model.to(device)
    model.head.weight = model.embed.weight  # Module.to() onto XLA makes new Parameters: tie again
    if checkpoint_probe:
        model.up_calls = 0

        def count(*_: Any) -> None:
            model.up_calls += 1

        for block in model.blocks:
            block.up.register_forward_hook(count)
    return model


def local_batch(step: int, rank: int, world_size: int, device: torch.device | str):
    """This replica's slice of global batch ``step``, on ``device``."""
    ids, labels = batch(step, GLOBAL_BATCH)
    return ids.chunk(world_size)[rank].to(device), labels.chunk(world_size)[rank].to(device)


def gradient_squares(module: torch.nn.Module) -> dict[str, float]:
    """Each parameter's sum of squared gradient elements held by this process (its rows at stages
    1-3), read on the CPU after backward: the replicas' squares of one shard group add up to the
    whole gradient's."""
    named = [(name, p.grad.detach()) for name, p in module.named_parameters() if p.grad is not None]
    if not named:
        return {}
    # one device-to-host transfer for all of them: on XLA each .cpu() would run a graph of its own
    squares = torch.stack([g.float().pow(2).sum() for _, g in named]).cpu().double().tolist()
    return {name: value for (name, _), value in zip(named, squares, strict=True)}


def train_on_cpu_backend(stage: int, steps: int, checkpointing: bool = False) -> dict[str, Any]:
    """The reference: the core on the CPU backend, one process, full batches."""
    from xshard.backends import get_backend
    from xshard.sharding import ShardingOptions, shard_model

    backend = get_backend("cpu")
    backend.init_process_group()
    model = shard_model(build_tiny(), backend, ShardingOptions(stage=stage, activation_checkpointing=checkpointing))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(steps):
        loss = model(*local_batch(step, 0, 1, "cpu"))
        loss.backward()
        grads.append(gradient_squares(model.module))
        backend.optimizer_step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    state = model.full_state_dict()
    model.close()
    return {"losses": losses, "grads": grads, "state": state}


def train_core_on_xla(rank: int, world_size: int, stage: int, steps: int, checkpointing: bool = False,
                      step_with_xm: bool = False, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The core on this XLA replica. ``step_with_xm``: step with ``xm.optimizer_step`` as TPU scripts do;
    ``options``: more ShardingOptions (e.g. ``shard_group_size`` for hybrid sharding).

    Also reports the compile count after each step (after a barrier, so every replica's
    compilations are in), xm.all_reduce calls, the core's collective bytes, and whether
    ``xm.optimizer_step`` was patched while the model lived and restored after ``close()``.
    """
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from xshard.backends import get_backend
    from xshard.sharding import ShardingOptions, shard_model

    xm_all_reduce_calls = _count_xm_all_reduce()
    backend = get_backend("xla")
    device = backend.device()
    original_step = xm.optimizer_step
    model = build_tiny(device, checkpoint_probe=True)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)  # built before sharding: the Parameters stay the user's
    model = shard_model(model, backend, ShardingOptions(stage=stage, activation_checkpointing=checkpointing,
                                                        **(options or {})))
    patched = xm.optimizer_step is not original_step
    losses, compiles, up_calls, grads = [], [], [], []
    for step in range(steps):
        model.module.up_calls = 0
        loss = model(*local_batch(step, rank, world_size, device))
        loss.backward()
        grads.append(gradient_squares(model.module))
        if step_with_xm:
            xm.optimizer_step(opt)
        else:
            backend.optimizer_step(opt)
        opt.zero_grad()
        losses.append(loss.detach())
        up_calls.append(model.module.up_calls)
        backend.collectives.barrier()
        compiles.append(met.metric_data("CompileTime")[0])
    # The compile count is the process's (the replicas are threads of it): no replica may go on to the
    # work below, which compiles more graphs, before every replica has read its last count.
    backend.collectives.barrier()
    # Each replica's own shards (the full_state_dict gather is left out on purpose: it reads the
    # result on rank 0 only, and on XLA:CPU that re-runs the gather there, see the report in
    # test_xla_core_parity); ``assemble_shards`` puts them together.
    shards = {name: p.detach().cpu() for name, p in model.module.named_parameters()}
    comm = model.stats()["comm"]
    model.close()
    backend.collectives.barrier()  # every replica has closed its model: the patch is released
    return {
        "losses": [loss.item() for loss in losses], "grads": grads, "shards": shards, "compiles": compiles, "up_calls": up_calls,
        "patched": patched, "restored": xm.optimizer_step is original_step,
        "params_kept": all(a is b for a, b in zip(model.parameters(), params, strict=True)),
        "xm_all_reduce_calls": xm_all_reduce_calls(), "comm": comm,
    }


def assemble_shards(results: list[dict[str, Any]], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full parameters from every replica's dim-0 shards (rank order), shaped like ``reference``'s.

    Stage 0 replicates: there every replica holds the whole parameter, and rank 0's is taken.
    """
    full = {}
    for name in results[0]["shards"]:
        parts = [r["shards"][name] for r in results]
        if all(p.shape == reference[name].shape for p in parts) and len(parts) > 1:
            full[name] = parts[0]
        else:
            full[name] = torch.cat([p.reshape(-1) for p in parts]).reshape(reference[name].shape)
    return full


_spy_lock = threading.Lock()
_spy_calls: dict[int, int] = {}


def _count_xm_all_reduce():
    """Count ``xm.all_reduce`` calls of this replica (the gradient all-reduce of xm.optimizer_step)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    with _spy_lock:
        if not getattr(xm.all_reduce, "_xshard_counter", False):
            real = xm.all_reduce

            @functools.wraps(real)
            def counting(*args: Any, **kwargs: Any) -> Any:
                _spy_calls[xr.global_ordinal()] = _spy_calls.get(xr.global_ordinal(), 0) + 1
                return real(*args, **kwargs)

            counting._xshard_counter = True
            xm.all_reduce = counting
        _spy_calls[rank] = 0
    return lambda: _spy_calls.get(rank, 0)


def train_xla_fsdp(steps: int, checkpointing: bool = False) -> dict[str, Any]:
    """torch_xla's XlaFullyShardedDataParallel on one XLA device: Blocks auto-wrapped (optionally
    behind ``checkpoint_module``), ``optimizer.step()`` then ``mark_step``, as its docs say."""
    import torch_xla
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

    device = torch_xla.device()
    model = build_tiny(device, checkpoint_probe=True)
    kwargs: dict[str, Any] = {"auto_wrap_policy": functools.partial(transformer_auto_wrap_policy,
                                                                    transformer_layer_cls={Block})}
    if checkpointing:
        kwargs["auto_wrapper_callable"] = lambda m, *a, **k: FSDP(checkpoint_module(m), *a, **k)
    fsdp = FSDP(model, **kwargs)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    losses, up_calls = [], []
    for step in range(steps):
        model.up_calls = 0
        loss = fsdp(*local_batch(step, 0, 1, device))
        loss.backward()
        opt.step()
        torch_xla.sync()
        opt.zero_grad()
        losses.append(loss.detach())
        up_calls.append(model.up_calls)
    return {"losses": [loss.item() for loss in losses], "state": xla_fsdp_full_state_dict(fsdp),
            "up_calls": up_calls}


def xla_fsdp_full_state_dict(fsdp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of a one-replica XlaFullyShardedDataParallel model, keyed like the user's module.

    torch_xla's consolidate_sharded_state_dicts fails on 0-dim parameters (``view(*())``), so
    this reads the shard metadata itself: each flat shard cut to the original size and reshaped.
    """
    meta = fsdp.get_shard_metadata()
    if meta["world_size"] != 1:
        raise ValueError("xla_fsdp_full_state_dict reads one replica's shards only")
    wrapper_parts = {"_fsdp_wrapped_module", "_fpw_module"}
    full = {}
    for key, value in fsdp.state_dict().items():
        parts = key.split(".")
        if not any(p.startswith("_fsdp_shard") for p in parts):
            continue
        cut = next(i for i, p in enumerate(parts) if p.startswith("_fsdp_shard"))
        prefix, suffix = ".".join(parts[:cut]), ".".join(parts[cut:])
        info = meta["shard_info"][prefix][suffix]
        size = tuple(info["_orig_size"])
        numel = int(torch.Size(size).numel())
        name = ".".join(p for p in (*parts[:cut], *info["_orig_name"].split(".")) if p not in wrapper_parts)
        full[name] = value.detach().cpu().reshape(-1)[:numel].reshape(size)
    return full
