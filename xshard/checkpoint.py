"""Save and resume a training job: ``Accelerator.save_state`` / ``load_state``.

Layout of a checkpoint directory:

    xshard_state.json            world size, stage, counts of each object (checked on load)
    model.safetensors            full weights of the first prepared model (model_1... for more)
    optimizer.rank{R}.pt         rank R's optimizer state (over its shards at stages 1-3)
    scheduler.pt                 LR schedulers' states (a list)
    data.pt                      prepared data loaders' positions (epoch, batches consumed)
    scaler.pt                    fp16 grad scaler state
    rng.rank{R}.pt               torch CPU, device, python and numpy RNG states of rank R

The directory appears atomically: every rank writes into ``<dir>.tmp``, each file is fsync'ed, then
rank 0 renames the folder into place (an existing checkpoint of the same name is replaced only
after the new one is complete). All ranks must see the same filesystem (one node, or a shared
one). Full weights are gathered to rank 0 and written as safetensors, so a checkpoint loads into
any other tool; optimizer state is saved per rank, so resuming needs the same world size and stage.
Gradients accumulated inside an unfinished accumulation window are not saved (a warning says so):
save at the end of a window to resume exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .log import get_logger

if TYPE_CHECKING:
    from .accelerator import Accelerator

log = get_logger("xshard.checkpoint")

STATE_FILE = "xshard_state.json"
FORMAT_VERSION = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a job that does not match this one (world size, stage, objects)."""


def _model_file(i: int) -> str:
    return "model.safetensors" if i == 0 else f"model_{i}.safetensors"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_torch(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    _fsync_file(path)


def _untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): give each key its own copy."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        t = tensor.detach().contiguous()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
        out[key] = t.clone() if ident in seen else t
        seen.add(ident)
    return out


def _load(path: Path) -> Any:
    # Not weights_only: the files hold python and numpy RNG states, written by save_state.
    return torch.load(path, weights_only=False)


def _meta(acc: Accelerator) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "world_size": acc.world_size,
        "stage": acc.sharding_options().stage,
        "models": len(acc._models),
        "optimizers": len(acc._optimizers),
        "schedulers": len(acc._schedulers),
        "data_loaders": len(acc._loaders),
        "fp16_scaler": acc.scaler is not None,
        "micro_step": acc._micro_step,
    }


def _rng_state(acc: Accelerator) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "device": acc.backend.rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(acc: Accelerator, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    acc.backend.set_rng_state(state.get("device"))
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_state(acc: Accelerator, directory: str | os.PathLike) -> Path:
    """Write the job's state to ``directory`` (all ranks call this); returns the final path."""
    from safetensors.torch import save_file

    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if acc._micro_step != 0:
        warnings.warn(
            f"save_state({str(final)!r}) inside an accumulation window ({acc._micro_step} of "
            f"{acc.gradient_accumulation_steps} micro-steps done): the gradients accumulated so far are not "
            "saved, so a resumed run steps with fewer samples in this window. Save after optimizer.step() "
            "at the end of a window (when accelerator.sync_gradients is True) to resume exactly.",
            stacklevel=3,
        )
    if acc.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()

    # Every rank takes part in gathering full weights; rank 0 writes them.
    for i, model in enumerate(acc._models):
        weights = acc.full_state_dict(model)
        if acc.is_main_process:
            path = tmp / _model_file(i)
            save_file(_untie(weights), str(path), metadata={"format": "pt"})
            _fsync_file(path)
        del weights
    rank = acc.rank
    _save_torch([opt.state_dict() for opt in acc._optimizers], tmp / f"optimizer.rank{rank}.pt")
    _save_torch(_rng_state(acc), tmp / f"rng.rank{rank}.pt")
    if acc.is_main_process:
        _save_torch([s.state_dict() for s in acc._schedulers], tmp / "scheduler.pt")
        _save_torch([d.state_dict() for d in acc._loaders], tmp / "data.pt")
        if acc.scaler is not None:
            _save_torch(acc.scaler.state_dict(), tmp / "scaler.pt")
        meta_path = tmp / STATE_FILE
        meta_path.write_text(json.dumps(_meta(acc), indent=2))
        _fsync_file(meta_path)
    acc.wait_for_everyone()

    if acc.is_main_process:
        _fsync_dir(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)
        log.info("saved checkpoint to %s", final)
    acc.wait_for_everyone()
    return final


def load_state(acc: Accelerator, directory: str | os.PathLike) -> None:
    """Restore what ``save_state`` wrote into the objects this Accelerator prepared."""
    from safetensors.torch import load_file

    root = Path(directory)
    meta_path = root / STATE_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{root} is not an xshard checkpoint: {STATE_FILE} is missing")
    meta = json.loads(meta_path.read_text())
    now = _meta(acc)
    for key in ("world_size", "stage", "models", "optimizers", "schedulers", "data_loaders", "fp16_scaler"):
        if meta.get(key) != now[key]:
            raise CheckpointMismatchError(
                f"{root}: the checkpoint has {key}={meta.get(key)!r} but this job has {key}={now[key]!r}; "
                "resume with the same world size, stage and prepared objects (full weights alone load "
                f"into any job from {_model_file(0)})"
            )
    for i, model in enumerate(acc._models):
        weights = load_file(str(root / _model_file(i)))
        if hasattr(model, "load_full_state_dict"):
            model.load_full_state_dict(weights)
        else:
            model.load_state_dict(weights)
        del weights
    rank = acc.rank
    # The counts were checked against the checkpoint above, so these zips are exact.
    for opt, state in zip(acc._optimizers, _load(root / f"optimizer.rank{rank}.pt"), strict=True):
        opt.load_state_dict(state)
    for sched, state in zip(acc._schedulers, _load(root / "scheduler.pt"), strict=True):
        sched.load_state_dict(state)
    for loader, state in zip(acc._loaders, _load(root / "data.pt"), strict=True):
        loader.load_state_dict(state)
    if acc.scaler is not None:
        acc.scaler.load_state_dict(_load(root / "scaler.pt"))
    _set_rng_state(acc, _load(root / f"rng.rank{rank}.pt"))
    acc._micro_step = int(meta.get("micro_step", 0))
    acc.wait_for_everyone()
    log.info("resumed from %s", root)
