"""Save and resume a training job: ``Accelerator.save_state`` / ``load_state``.

A checkpoint folder holds:

    xshard_state.json            the manifest, written last: format version, xshard version, world size,
                                 shard group size (hybrid sharding), stage, backend, state_dict_type,
                                 step, the xshard config, row tables of
                                 every tensor, and the size and sha256 of every other file
    model*.safetensors           model weights (formats.py: full, local or sharded layout)
    optimizer*                   optimizer state (per rank, or by rows for "sharded")
    scheduler.pt data.pt         LR schedulers, data loaders' positions (epoch, batches consumed)
    scaler.pt                    fp16 grad scaler (when there is one)
    rng.rank{R}.pt               python, numpy, torch and device RNG states of rank R
    custom_checkpoint_{i}.pt     ``state_dict()`` of each object given to ``register_for_checkpointing``
    config.json                  the first model's own config, when it has ``config.to_json_string``
                                 (a transformers model): ``xshard consolidate`` then writes a
                                 ``from_pretrained`` folder

Saving is atomic (files.py): a crash or a killed rank leaves the previous checkpoint intact
and a ``.tmp`` folder that ``latest_checkpoint`` skips. Loading reads only safetensors and
``torch.load(weights_only=True)``, checks every file's size and checksum, the model's keys and
shapes and the job's compatibility on every rank *before* anything changes; the ranks agree on the
outcome, so a bad checkpoint raises the same error everywhere and leaves the running job untouched.
All ranks must see the same filesystem (one node, or a shared one). Gradients accumulated inside an
unfinished accumulation window are not saved (a warning says so): save at the end of a window.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..log import get_logger
from . import formats
from .files import (
    FORMAT_VERSION,
    MANIFEST,
    OLD_SUFFIX,
    CheckpointError,
    CheckpointMismatchError,
    FileWriter,
    begin,
    commit,
    latest_checkpoint,
    load_torch,
    read_manifest,
    rotate,
    write_manifest,
)

if TYPE_CHECKING:
    from ..job import JobState

__all__ = ["CheckpointError", "CheckpointMismatchError", "latest_checkpoint", "load_state", "save_state"]

log = get_logger("xshard.checkpoint")

_COUNTS = ("models", "optimizers", "schedulers", "data_loaders", "fp16_scaler")


def _hybrid_group(job: JobState) -> int | None:
    """The shard group size under hybrid sharding (None: sharded over the whole world, or not at all)."""
    sizes = {m.plan.shard_group_size for m in job.models if m.plan.shard_parameters}
    size = min(sizes) if sizes else job.world_size
    return None if size == job.world_size else size


def _job(job: JobState) -> dict[str, Any]:
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


def _rng_state(job: JobState) -> dict[str, Any]:
    # Plain tensors, tuples and ints only, so that torch.load(weights_only=True) reads it back.
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    device = job.backend.rng_state()
    if device is not None:
        state["device"] = device.detach().cpu()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    return state


def _set_rng_state(job: JobState, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    job.backend.set_rng_state(state.get("device"))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _model_config(model: Any) -> str | None:
    config = getattr(getattr(model, "module", model), "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) else None


def save_state(job: JobState, directory: str | os.PathLike, state_dict_type: str | None = None,
               save_total_limit: int | None = None) -> Path:
    """Write the job's state to ``directory`` (every rank calls this); returns the final path.

    ``state_dict_type``: "full", "local" or "sharded" (default: the config's). ``save_total_limit``:
    afterwards keep only that many complete checkpoints in ``directory``'s parent folder, deleting the
    oldest (never the one just written).
    """
    kind = state_dict_type or job.config.state_dict_type
    if kind not in formats.STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={kind!r}: use one of {', '.join(formats.STATE_DICT_TYPES)}")
    final = Path(directory)
    if job.micro_step != 0:
        warnings.warn(
            f"save_state({str(final)!r}) inside an accumulation window ({job.micro_step} of "
            f"{job.gradient_accumulation_steps} micro-steps done): the gradients accumulated so far are not "
            "saved, so a resumed run steps with fewer samples in this window. Save after optimizer.step() "
            "at the end of a window (when accelerator.sync_gradients is True) to resume exactly.",
            stacklevel=3,
        )
    tmp = begin(final, job.is_main_process)
    job.barrier()
    job.backend.mark_step()  # compiled devices: materialise pending updates before reading tensors

    writer = FileWriter(tmp, job.rank)
    tables: dict[str, Any] = {}
    models = job.models
    for i, model in enumerate(models):
        if kind == "full":
            weights = model.full_state_dict(rank0_only=True)  # every rank takes part; complete on rank 0
            if job.is_main_process:
                tables[f"model{i}"] = formats.write_full_model(writer, i, weights)
            del weights
        else:
            tables[f"model{i}"] = formats.write_model_rows(writer, i, model)
    groups = []
    if kind == "sharded":
        for i, opt in enumerate(job.optimizers):
            tables[f"optimizer{i}"], record = formats.write_optimizer_rows(writer, i, opt.optimizer, models)
            groups.append(record)
        if job.is_main_process:
            writer.torch("optimizer.groups.pt", groups)
    else:
        writer.torch(f"optimizer.rank{job.rank}.pt", [opt.state_dict() for opt in job.optimizers])
    writer.torch(f"rng.rank{job.rank}.pt", _rng_state(job))
    if job.is_main_process:
        writer.torch("scheduler.pt", [s.state_dict() for s in job.schedulers])
        writer.torch("data.pt", [d.state_dict() for d in job.loaders])
        if job.scaler is not None:
            writer.torch("scaler.pt", job.scaler.state_dict())
        _write_custom(job, writer)
        config_json = _model_config(models[0]) if models else None
        if config_json is not None:
            writer.text("config.json", config_json)
    # Each rank's file list and row tables travel to rank 0 through the shared folder.
    fragment = tmp / f"fragment.rank{job.rank}.json"
    fragment.write_text(json.dumps({"files": writer.files, "tables": tables}, default=str))
    job.barrier()

    if job.is_main_process:
        from .. import __version__

        files: dict[str, Any] = {}
        parts: dict[str, list[dict[str, Any]]] = {}
        for rank in range(job.world_size):
            path = tmp / f"fragment.rank{rank}.json"
            part = json.loads(path.read_text())
            path.unlink()
            files.update(part["files"])
            for name, table in part["tables"].items():
                parts.setdefault(name, []).append(table)
        manifest = {
            "format_version": FORMAT_VERSION,
            "xshard_version": __version__,
            "state_dict_type": kind,
            **_job(job),
            "step": job.step,
            "micro_step": job.micro_step,
            "config": job.config.to_dict(),
            "tables": {name: formats.merge_tables(p) for name, p in parts.items()},
            "files": files,
        }
        write_manifest(tmp, manifest)
        commit(tmp, final)
        log.info("saved %s checkpoint to %s", kind, final)
        if save_total_limit is not None:
            for path in rotate(final.parent, save_total_limit, final):
                log.info("deleted old checkpoint %s (save_total_limit=%d)", path, save_total_limit)
    job.barrier()
    return final


def _read_everything(job: JobState, root: Path) -> dict[str, Any]:
    """Read and check all this rank needs from the checkpoint; change nothing."""
    manifest = read_manifest(root)
    kind = manifest.get("state_dict_type")
    if kind not in formats.STATE_DICT_TYPES:
        raise CheckpointError(f"{root / MANIFEST}: key 'state_dict_type' is {kind!r}, expected one of "
                              f"{', '.join(formats.STATE_DICT_TYPES)}")
    now = _job(job)
    if kind == "sharded":
        formats.check_same_job(manifest, now, root, _COUNTS)
    else:
        formats.check_same_job(manifest, now, root, ("world_size", "shard_group_size", "stage", *_COUNTS))
    reader = formats.RowReader(root, manifest)
    tables = manifest.get("tables", {})
    plan: dict[str, Any] = {"manifest": manifest, "models": [], "optimizers": []}
    for i, model in enumerate(job.models):
        table = tables.get(f"model{i}")
        if table is None:
            raise CheckpointError(f"{root / MANIFEST}: key 'tables' has no 'model{i}'")
        plan["models"].append(formats.read_model_rows(reader, table, model, f"model {i}"))
    if kind == "sharded":
        records = load_torch(root, "optimizer.groups.pt", manifest)
        for i, opt in enumerate(job.optimizers):
            plan["optimizers"].append(formats.read_optimizer_rows(
                reader, tables.get(f"optimizer{i}", {}), records[i], opt.optimizer, job.models, f"optimizer {i}"))
    else:
        plan["optimizers"] = formats.load_rank_optimizers(root, manifest, job.rank)
    plan["schedulers"] = load_torch(root, "scheduler.pt", manifest)
    plan["data"] = load_torch(root, "data.pt", manifest)
    plan["scaler"] = load_torch(root, "scaler.pt", manifest) if job.scaler is not None else None
    plan["custom"] = _read_custom(job, root, manifest)
    rng_name = f"rng.rank{job.rank}.pt"
    # A different world size: ranks without their own RNG file take rank 0's (and say so).
    plan["rng"] = load_torch(root, rng_name if rng_name in manifest["files"] else "rng.rank0.pt", manifest)
    return plan


def _agree(job: JobState, error: BaseException | None, root: Path) -> None:
    """Every rank learns whether any rank failed to read the checkpoint, so all raise or none does."""
    if job.world_size > 1:
        flag = torch.tensor([0.0 if error is None else 1.0], device=job.backend.device())
        job.backend.collectives.all_reduce(flag, op="sum")
        failed = int(flag.item())
    else:
        failed = int(error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{root}: {failed} other rank(s) could not read this checkpoint (their error is in "
                              "their log); nothing was loaded")


def load_state(job: JobState, directory: str | os.PathLike) -> Path:
    """Restore what ``save_state`` wrote into the objects this Accelerator prepared; returns the path.

    Everything is read and checked first; the model, optimizer and the rest change only when every
    rank read the whole checkpoint successfully.
    """
    root = Path(directory)
    old = root.with_name(root.name + OLD_SUFFIX)
    if not root.exists() and (old / MANIFEST).is_file():  # a crash between the two renames of commit()
        root = old
    error: BaseException | None = None
    plan: dict[str, Any] = {}
    try:
        plan = _read_everything(job, root)
    except Exception as exc:  # every failure must reach _agree, or the other ranks would wait forever
        log.error("rank %d cannot load %s: %s", job.rank, root, exc)
        error = exc if isinstance(exc, CheckpointError) else CheckpointError(f"{root}: {exc}")
        if error is not exc:
            error.__cause__ = exc
    _agree(job, error, root)

    from ..sharding.state_dict import load_local_pieces

    for model, rows in zip(job.models, plan["models"], strict=True):
        load_local_pieces(model, rows)
    for opt, state in zip(job.optimizers, plan["optimizers"], strict=True):
        opt.load_state_dict(state)
    for sched, state in zip(job.schedulers, plan["schedulers"], strict=True):
        sched.load_state_dict(state)
    for loader, state in zip(job.loaders, plan["data"], strict=True):
        loader.load_state_dict(state)
    if job.scaler is not None:
        job.scaler.load_state_dict(plan["scaler"])
    for obj, state in zip(job.custom_objects, plan["custom"], strict=True):
        obj.load_state_dict(state)
    _set_rng_state(job, plan["rng"])
    manifest = plan["manifest"]
    job.micro_step = int(manifest.get("micro_step", 0))
    job.step = int(manifest.get("step", 0))
    job.barrier()
    log.info("resumed from %s (step %d)", root, job.step)
    return root


def _custom_name(index: int) -> str:
    return f"custom_checkpoint_{index}.pt"


def _write_custom(job: JobState, writer: FileWriter) -> None:
    """Registered objects' ``state_dict()`` (main process; loaded back with ``weights_only=True``)."""
    for i, obj in enumerate(job.custom_objects):
        writer.torch(_custom_name(i), obj.state_dict())


def _read_custom(job: JobState, root: Path, manifest: dict[str, Any]) -> list[Any]:
    """The registered objects' states; the checkpoint must hold one per registered object."""
    saved = sum(1 for name in manifest.get("files", {}) if name.startswith("custom_checkpoint_"))
    if saved != len(job.custom_objects):
        raise CheckpointMismatchError(
            f"{root}: the checkpoint holds {saved} object(s) registered for checkpointing but this job registered "
            f"{len(job.custom_objects)}: call accelerator.register_for_checkpointing(...) with the same objects "
            "before load_state")
    return [load_torch(root, _custom_name(i), manifest) for i in range(saved)]


def resume(job: JobState, output_dir: str | os.PathLike) -> Path | None:
    """Load the newest complete checkpoint under ``output_dir``; None (and nothing loaded) if there is none."""
    path = latest_checkpoint(output_dir)
    if path is None:
        log.info("no complete checkpoint under %s: starting from scratch", output_dir)
        return None
    return load_state(job, path)
