"""Checkpoint folders written by Hugging Face Accelerate's ``save_state``, read into an xshard job.

So that a run moves over from Accelerate + FSDP (or DDP) without starting again. The file names are
Accelerate's (``accelerate/utils/fsdp_utils.py`` ``save_fsdp_model`` / ``save_fsdp_optimizer`` and
``accelerate/checkpointing.py`` ``save_accelerator_state``), ``_{i}`` marking the i-th prepared object:

    pytorch_model_fsdp.bin           FSDP FULL_STATE_DICT: the model's full state dict (torch.save)
    pytorch_model_fsdp_0/            FSDP SHARDED_STATE_DICT: a torch.distributed.checkpoint (DCP)
                                     folder holding {"model": state_dict}
    model.safetensors                a model that was not FSDP-wrapped (DDP, one device);
    pytorch_model.bin                 the same with safe_serialization=False
    optimizer.bin                    the optimizer's full state dict, keyed by parameter name (FSDP's
                                     optim_state_dict) or by position (a plain optimizer.state_dict())
    optimizer_0/                     SHARDED_STATE_DICT: a DCP folder holding {"optimizer": ...}
    scheduler.bin, scaler.pt         torch.save of their state dicts
    random_states_{rank}.pkl         RNG states and Accelerate's micro-step counter ``step``

Everything is read by rows (``sources.py``), as xshard's own checkpoints are, so any world size
and stage resume it: a DCP folder through DCP's own reader, asked for this rank's rows only, a
``.bin`` file memory-mapped and read with ``torch.load(weights_only=True)`` (numpy's RNG arrays
allowed). A DCP folder's ``.metadata`` pickle is read with only DCP's metadata types allowed
(``dcp_metadata.py``), so a crafted folder runs no code. A data loader's position is read where Accelerate
saved one: ``dl_state_dict.bin`` (``use_stateful_dataloader=True``, torchdata's ``StatefulDataLoader`` state) gives
the batches this rank's pass had yielded (``_num_yielded``), and the loader resumes after them in its current
epoch, as Accelerate's own ``load_state`` resumes it. ``sampler.bin`` (a pickled sampler object) is never read:
without ``dl_state_dict.bin`` the loaders start at the beginning of their epoch, as after Accelerate's own
``load_state``, and a log line says so. FSDP's LOCAL_STATE_DICT (flattened per-rank shards only FSDP can read)
is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.rank_logging import get_logger
from .files import CheckpointError, CheckpointMismatchError
from .formats import optimizer_param_keys, read_model_rows, read_optimizer_rows
from .load_plan import LoadPlan
from .sources import DcpSource, DictSource, SafetensorsSource

if TYPE_CHECKING:
    from ..runtime.job import JobState

log = get_logger("xshard.checkpoint")

FSDP_MODEL = "pytorch_model_fsdp"
#: files that only Accelerate's save_state writes (a bare from_pretrained folder has none of them)
_MARKERS = ("random_states_0.pkl", "optimizer.bin", "optimizer_0", "scheduler.bin")


def _indexed(base: str, i: int, suffix: str = "") -> str:
    """Accelerate's name of the i-th object's file: ``base`` for the first, ``base_{i}`` after."""
    return f"{base}{suffix}" if i == 0 else f"{base}_{i}{suffix}"


def is_foreign_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` looks like a folder Accelerate's ``save_state`` wrote."""
    return folder.is_dir() and any((folder / marker).exists() for marker in _MARKERS)


# ---------------------------------------------------------------------- reading a folder


def _torch_load(path: Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``, with numpy's arrays allowed (Accelerate's RNG files hold them)."""
    import numpy as np

    # numpy 2 moved numpy.core to numpy._core (numpy.core still imports, with a DeprecationWarning at each use);
    # both names hold the same function
    core: Any = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read safely ({exc})") from exc


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A model's state dict from a ``.bin`` file: names to tensors, or a CheckpointError naming the file."""
    weights = _torch_load(path, mmap=True)
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{path} holds a {type(weights).__name__} that is not a model's state dict (names to "
                              "tensors); load a checkpoint that Accelerate's save_state wrote")
    return weights


def _model_source(folder: Path, i: int) -> Any:
    full = folder / _indexed(FSDP_MODEL, i, ".bin")
    if full.is_file():
        return DictSource(folder, _state_dict(full), full)
    sharded = folder / f"{FSDP_MODEL}_{i}"
    if sharded.is_dir():
        return DcpSource(sharded, ("model",))
    safe = folder / _indexed("model", i, ".safetensors")
    if safe.is_file():
        return SafetensorsSource(folder, safe)
    plain = folder / _indexed("pytorch_model", i, ".bin")
    if plain.is_file():
        return DictSource(folder, _state_dict(plain), plain)
    local = sorted(folder.glob(f"{_indexed(FSDP_MODEL, i)}_rank*.bin"))
    if local:
        raise CheckpointError(f"{local[0]}: FSDP LOCAL_STATE_DICT files hold FSDP's flattened per-rank shards, "
                              "which only FSDP reads; save with FULL_STATE_DICT or SHARDED_STATE_DICT to move over")
    raise CheckpointError(f"{folder}: no weights of model {i} (expected {_indexed(FSDP_MODEL, i, '.bin')}, "
                          f"{FSDP_MODEL}_{i}/, {_indexed('model', i, '.safetensors')} or "
                          f"{_indexed('pytorch_model', i, '.bin')})")


def _full_optimizer(folder: Path, full: Path, state_dict: Any,
                    keys: list[list[str]]) -> tuple[DictSource, dict[str, Any]]:
    """An ``optimizer.bin`` state dict (keyed by parameter name or by position) as a source and a record."""
    names = [k for group in keys for k in group]
    saved_params = [p for g in state_dict["param_groups"] for p in g["params"]]
    by_position = all(isinstance(p, int) for p in saved_params)  # a plain optimizer.state_dict()
    if by_position and len(saved_params) != len(names):
        raise CheckpointMismatchError(f"{full}: the optimizer has {len(saved_params)} parameters in the "
                                      f"checkpoint, {len(names)} here; build it with the same parameters")
    name_of = dict(zip(saved_params, names, strict=False)) if by_position else {p: p for p in saved_params}
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, dict[str, Any]] = {}
    for param, values in state_dict["state"].items():
        if param not in name_of:
            raise CheckpointMismatchError(f"{full}: key 'state' holds parameter {param!r}, which is in none of the "
                                          "checkpoint's param groups; load a checkpoint of this optimizer")
        for state_name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name_of[param]}/{state_name}"] = value
            else:
                extra.setdefault(name_of[param], {})[state_name] = value
    groups = state_dict["param_groups"]
    record = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
              "param_keys": [[name_of[p] for p in g["params"]] for g in groups], "extra": extra}
    return DictSource(folder, tensors, full), record


def _optimizer_source(folder: Path, i: int, keys: list[list[str]]) -> tuple[Any, dict[str, Any]]:
    """(source of ``<param>/<state>`` tensors, record of param groups) of optimizer ``i``."""
    full = folder / _indexed("optimizer", i, ".bin")
    sharded = folder / f"optimizer_{i}"
    if full.is_file():
        state_dict = _torch_load(full, mmap=True)
        try:
            return _full_optimizer(folder, full, state_dict, keys)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{full} is not an optimizer state dict as Accelerate saves it ({type(exc).__name__}: "
                                  f"{exc}); load a checkpoint that Accelerate's save_state wrote") from exc
    if sharded.is_dir():
        source = DcpSource(sharded, ("optimizer", "state"))
        groups_source = DcpSource(sharded, ("optimizer", "param_groups"))
        values = groups_source.read_bytes(list(groups_source.byte_keys.values()))
        by_index: dict[int, dict[str, Any]] = {}
        for (index, field), key in groups_source.byte_keys.items():
            by_index.setdefault(int(index), {})[field] = values[key]
        ordered = [by_index[g] for g in sorted(by_index)]
        record = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in ordered],
                  "param_keys": [list(g.get("params", [])) for g in ordered], "extra": {}}
        return source, record
    raise CheckpointError(f"{folder}: no state of optimizer {i} (expected {_indexed('optimizer', i, '.bin')} or "
                          f"optimizer_{i}/)")


def _rng(folder: Path, rank: int) -> dict[str, Any] | None:
    """Accelerate's RNG file of this rank (rank 0's on a larger world), as xshard's RNG state."""
    path = folder / f"random_states_{rank}.pkl"
    if not path.is_file():
        path = folder / "random_states_0.pkl"
    if not path.is_file():
        return None
    states = _torch_load(path)
    try:
        out: dict[str, Any] = {"torch": states["torch_manual_seed"], "python": states["random_state"],
                               "accelerate_step": int(states.get("step", 0))}
        if "numpy_random_seed" in states:
            kind, keys, pos, has_gauss, cached = states["numpy_random_seed"]
            out["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{path} does not hold Accelerate's RNG states ({type(exc).__name__}: {exc}); remove "
                              "it to resume without them, or load a checkpoint that Accelerate's save_state "
                              "wrote") from exc
    return out


def _loader_position(folder: Path, i: int, loader: Any) -> dict[str, Any] | None:
    """Loader ``i``'s position from Accelerate's ``dl_state_dict.bin`` (None where there is none): the batches
    this rank's pass had yielded (torchdata's ``_num_yielded``; its ``_iterator_finished`` pass counts whole), in
    the loader's current epoch."""
    path = folder / _indexed("dl_state_dict", i, ".bin")
    if not path.is_file():
        return None
    state = _torch_load(path)
    yielded = state.get("_num_yielded") if isinstance(state, dict) else None
    if not isinstance(yielded, int) or yielded < 0:
        raise CheckpointError(f"{path} is not a data loader state Accelerate saved (no count of the batches "
                              "yielded, '_num_yielded'); remove it to resume at the beginning of the epoch")
    if state.get("_iterator_finished"):
        yielded = max(yielded, len(loader))
    return {"epoch": loader.epoch, "batches_consumed": yielded}


def read_plan(job: JobState, folder: Path) -> LoadPlan:
    """Everything this rank needs from an Accelerate folder, checked against the job; changes nothing."""
    models: list[dict[str, torch.Tensor] | None] = [read_model_rows(_model_source(folder, i), model, f"model {i}")
                                                    for i, model in enumerate(job.models)]
    optimizers: list[dict[str, Any] | None] = []
    for i, opt in enumerate(job.optimizers):
        source, record = _optimizer_source(folder, i, optimizer_param_keys(opt.optimizer, job.models))
        optimizers.append(read_optimizer_rows(source, record, opt.optimizer, job.models, f"optimizer {i}",
                                              job.rank, job.world_size))
    schedulers = []
    for i in range(len(job.schedulers)):
        path = folder / _indexed("scheduler", i, ".bin")
        if not path.is_file():
            raise CheckpointError(f"{folder}: no state of LR scheduler {i} (expected {path.name})")
        schedulers.append(_torch_load(path))
    plan = LoadPlan(step=job.step, models=models, optimizers=optimizers, schedulers=schedulers)
    if job.scaler is not None and (folder / "scaler.pt").is_file():
        plan.scaler = _torch_load(folder / "scaler.pt")
    rng = _rng(folder, job.rank)
    if rng is not None:
        # Accelerate's ``step`` counts micro-steps since the data loader's start, for the accumulation
        # window; it does not count optimizer steps, so xshard's step stays where it is.
        plan.micro_step = rng.pop("accelerate_step") % max(1, job.gradient_accumulation_steps)
        plan.rng = rng
    plan.data = [_loader_position(folder, i, loader) for i, loader in enumerate(job.loaders)]
    if any(position is None for position in plan.data):
        log.info("%s is an Accelerate checkpoint without the position of every data loader (dl_state_dict.bin: "
                 "Accelerate saves it with use_stateful_dataloader=True): those start at the beginning of their "
                 "epoch, as after Accelerate's load_state; skip batches yourself if you need to", folder)
    log.info("reading an Accelerate checkpoint from %s", folder)
    return plan


class AccelerateFolderFormat:
    """Folders Accelerate's ``save_state`` wrote (FSDP or DDP): a ``format_protocol.ForeignFormat``."""

    name = "accelerate"

    def recognises(self, folder: Path) -> bool:
        """Whether ``folder`` holds a file only Accelerate's ``save_state`` writes."""
        return is_foreign_checkpoint(folder)

    def read(self, job: JobState, folder: Path, on_bytes: Callable[[int], None] | None = None) -> LoadPlan:
        """This rank's plan of the folder (``read_plan``; the bytes read are not counted)."""
        return read_plan(job, folder)


ACCELERATE_FOLDER = AccelerateFolderFormat()
