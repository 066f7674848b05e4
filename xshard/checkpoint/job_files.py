"""The files every xshard checkpoint format writes beside its model and optimizer state, and their reading.

``rng.rank{R}.pt`` (every rank), and on the main process ``scheduler.pt``, ``data.pt``, ``scaler.pt`` (with an
fp16 scaler), ``custom_checkpoint_{i}.pt`` (objects registered for checkpointing) and ``config.json`` (the
first model's own config, when it has one). Also the job's facts that a manifest records and a load checks
(``job_facts``). One implementation for every format (``own_formats.py`` and any format added later).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .files import CheckpointMismatchError, load_torch
from .load_plan import LoadPlan
from .writer import Writer

if TYPE_CHECKING:
    from ..runtime.job import JobState

#: the manifest keys that count the job's prepared objects: every load checks them
COUNTS = ("models", "optimizers", "schedulers", "data_loaders", "fp16_scaler")


def _hybrid_group(job: JobState) -> int | None:
    """The shard group size under hybrid sharding (None: sharded over the whole world, or not at all)."""
    sizes = {m.plan.shard_group_size for m in job.models if m.plan.shard_parameters}
    size = min(sizes) if sizes else job.world_size
    return None if size == job.world_size else size


def job_facts(job: JobState) -> dict[str, Any]:
    """The job's shape as the manifest records it (``check_same_job`` compares a checkpoint's with these)."""
    return {
        "world_size": job.world_size,
        "shard_group_size": _hybrid_group(job),
        "stage": job.stage(),
        "backend": job.backend.name,
        "models": len(job.models),
        "optimizers": len(job.optimizers),
        "schedulers": len(job.schedulers),
        "data_loaders": len(job.loaders),
        "fp16_scaler": job.scaler is not None,
    }


def rng_state(job: JobState) -> dict[str, Any]:
    """This rank's python, numpy, torch and device RNG states, and what each data loader's rank alone knows."""
    # Plain tensors, tuples and ints only, so that torch.load(weights_only=True) reads it back.
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    # What each loader's rank alone knows of its position: the base seed its epoch drew from this rank's RNG,
    # and a stateful stream's own state (``ShardedDataLoader.rank_state_dict``).
    state["data_loaders"] = [loader.rank_state_dict() if hasattr(loader, "rank_state_dict") else {}
                             for loader in job.loaders]
    device = job.backend.rng_state()
    if device is not None:
        state["device"] = device.detach().cpu()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = cast("tuple[Any, ...]", np.random.get_state())  # the legacy tuple
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    return state


def set_rng_state(job: JobState, state: dict[str, Any]) -> None:
    """Put back what ``rng_state`` returned (or a foreign checkpoint's RNG states in its layout)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    job.backend.set_rng_state(state.get("device"))
    seeds = state.get("data_loaders") or []  # none in an older or a foreign checkpoint: the next pass draws afresh
    for i, loader in enumerate(job.loaders):
        if hasattr(loader, "load_rank_state_dict"):
            loader.load_rank_state_dict(seeds[i] if i < len(seeds) else None)
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class RngStates:
    """The job's RNG states as an object with a state dict (so that a load can put them back)."""

    def __init__(self, job: JobState) -> None:
        self.job = job

    def state_dict(self) -> dict[str, Any]:
        """This rank's RNG states now."""
        return rng_state(self.job)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set this rank's RNG states."""
        set_rng_state(self.job, state)


def _model_config(model: Any) -> str | None:
    config = getattr(getattr(model, "module", model), "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) else None


def _custom_name(index: int) -> str:
    return f"custom_checkpoint_{index}.pt"


def write_job_files(job: JobState, writer: Writer) -> None:
    """This rank's RNG file and, on the main process, the schedulers, loaders, scaler, custom objects and config."""
    writer.torch(f"rng.rank{job.rank}.pt", rng_state(job))
    if not job.is_main_process:
        return
    writer.torch("scheduler.pt", [s.state_dict() for s in job.schedulers])
    writer.torch("data.pt", [d.state_dict() for d in job.loaders])
    if job.scaler is not None:
        writer.torch("scaler.pt", job.scaler.state_dict())
    for i, obj in enumerate(job.custom_objects):  # loaded back with weights_only=True
        writer.torch(_custom_name(i), obj.state_dict())
    config_json = _model_config(job.models[0]) if job.models else None
    if config_json is not None:
        writer.text("config.json", config_json)


def _read_custom(job: JobState, root: Path, manifest: dict[str, Any],
                 on_bytes: Callable[[int], None] | None) -> list[Any]:
    """The registered objects' states; the checkpoint must hold one per registered object."""
    saved = sum(1 for name in manifest.get("files", {}) if name.startswith("custom_checkpoint_"))
    if saved != len(job.custom_objects):
        raise CheckpointMismatchError(
            f"{root}: the checkpoint holds {saved} object(s) registered for checkpointing but this job registered "
            f"{len(job.custom_objects)}: call accelerator.register_for_checkpointing(...) with the same objects "
            "before load_state")
    return [load_torch(root, _custom_name(i), manifest, on_bytes) for i in range(saved)]


def read_job_files(job: JobState, root: Path, manifest: dict[str, Any], models: list[dict[str, torch.Tensor] | None],
                   optimizers: list[dict[str, Any] | None],
                   on_bytes: Callable[[int], None] | None = None) -> LoadPlan:
    """The plan of a checkpoint whose ``models`` and ``optimizers`` a format read: the files of
    ``write_job_files`` added, each checked against the manifest as it is read."""
    rng_name = f"rng.rank{job.rank}.pt"
    return LoadPlan(
        step=manifest.get("step", 0), micro_step=manifest.get("micro_step", 0), models=models, optimizers=optimizers,
        schedulers=load_torch(root, "scheduler.pt", manifest, on_bytes),
        data=load_torch(root, "data.pt", manifest, on_bytes),
        scaler=load_torch(root, "scaler.pt", manifest, on_bytes) if job.scaler is not None else None,
        custom=_read_custom(job, root, manifest, on_bytes),
        # A different world size: ranks without their own RNG file take rank 0's.
        rng=load_torch(root, rng_name if rng_name in manifest["files"] else "rng.rank0.pt", manifest, on_bytes),
    )
