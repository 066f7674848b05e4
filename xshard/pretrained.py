"""Load a Hugging Face model folder straight into shards: no rank ever holds the whole model.

``from_pretrained_sharded(AutoModelForCausalLM, "/path/to/Qwen1.5-7B-Chat", acc)`` does what
``from_pretrained`` + ``acc.prepare(model)`` do, with a peak host memory per rank of about this
rank's shard instead of the whole model (measured in ``benchmarks/loading_memory.py``):

1. the model is built with its parameters on the meta device and its buffers computed by the
   modules themselves (``xshard.sharding.materialize.meta_parameters``): rotary ``inv_freq`` and
   other non-persistent buffers come out right, tied weights stay tied;
2. persistent buffers are loaded from the checkpoint (they are small);
3. the model is sharded (stages 1-3), then each rank reads only its own dim-0 rows of every tensor
   from the ``*.safetensors`` files (``safe_open(...).get_slice(name)[start:stop]``, memory-mapped).

Stage 0 replicates the model, so there every rank reads every tensor (once, into its parameters).
A checkpoint with only ``pytorch_model*.bin`` files cannot be read by rows: rank 0 loads it
(memory-mapped where the file allows) and broadcasts one tensor at a time, so the other ranks hold
at most one full tensor beyond their shards (a log line says so; convert the folder to safetensors
with ``save_pretrained`` to avoid it). Everything runs offline: only the local folder is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint.progress import slow_progress
from .runtime.rank_logging import get_logger
from .sharding import ShardedModel, ShardingOptions, ShardingPlan, shard_model
from .sharding.materialize import fill_parameters, fill_shards, meta_parameters

log = get_logger("xshard.pretrained")

SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"


class CheckpointFormatError(FileNotFoundError):
    """The folder holds no weights in a format this loader reads, or they do not match the model."""


# ---------------------------------------------------------------------------------------------- files
def checkpoint_files(folder: str | os.PathLike) -> tuple[str, dict[str, Path]]:
    """(``"safetensors"`` or ``"bin"``, tensor name -> file) for a Hugging Face model folder."""
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointFormatError(f"{root}: no such model folder (pass a local folder written by save_pretrained)")
    for kind, index, single in (("safetensors", SAFE_INDEX, SAFE_SINGLE), ("bin", BIN_INDEX, BIN_SINGLE)):
        if (root / index).is_file():
            weight_map = json.loads((root / index).read_text())["weight_map"]
            return kind, {name: root / file for name, file in weight_map.items()}
        if (root / single).is_file():
            return kind, {name: root / single for name in _names_in(kind, root / single)}
    raise CheckpointFormatError(
        f"{root}: no weights found (expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX})")


def _names_in(kind: str, file: Path) -> Iterable[str]:
    if kind == "safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:  # reads the header only
            return list(f.keys())
    return [""]  # a single .bin file: names are known once rank 0 loads it


def _find(names: list[str], available: Any) -> str:
    for name in names:
        if name in available:
            return name
    raise CheckpointFormatError(f"the checkpoint has no tensor named {' or '.join(map(repr, names))}: "
                                "it was written for another model class or config")


# ---------------------------------------------------------------------------------------------- readers
class SafetensorsRows:
    """Reads dim-0 row ranges from safetensors files (memory-mapped: only those rows are touched)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._open: dict[Path, Any] = {}
        self.elements_read = 0

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file]

    def __call__(self, names: list[str], start: int, stop: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        name = _find(names, self.files)
        handle = self._handle(self.files[name])
        tensor_slice = handle.get_slice(name)
        stored = tuple(tensor_slice.get_shape())
        if stored != tuple(shape):
            raise CheckpointFormatError(f"{name}: the checkpoint's tensor has shape {stored}, the model's parameter "
                                        f"{tuple(shape)}: the folder's config.json does not match its weights")
        rows = handle.get_tensor(name).reshape(1) if not stored else tensor_slice[start:stop]
        self.elements_read += rows.numel()
        return rows

    def full(self, name: str) -> torch.Tensor:
        """One whole tensor (for buffers)."""
        return self._handle(self.files[name]).get_tensor(name)

    def close(self) -> None:
        self._open.clear()


class BroadcastRows:
    """For ``.bin`` checkpoints: rank 0 loads the state dict, every tensor is broadcast as needed.

    Every rank must ask for the same tensors in the same order (``fill_shards`` does).
    """

    def __init__(self, files: dict[str, Path], collectives: Any, device: torch.device) -> None:
        self.collectives = collectives
        self.device = device
        self.rank = collectives.rank
        self.state: dict[str, torch.Tensor] = {}
        if self.rank == 0:
            for file in dict.fromkeys(files.values()):
                self.state.update(_torch_load(file))
        self.elements_read = 0

    def has(self, names: list[str]) -> bool:
        """Whether rank 0's checkpoint holds one of ``names`` (every rank gets the answer)."""
        flag = torch.tensor([float(any(n in self.state for n in names))], device=self.device)
        self.collectives.broadcast(flag, src=0)
        return bool(flag.item())

    def __call__(self, names: list[str], start: int, stop: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if not self.has(names):
            _find(names, ())  # raises, naming the tensor, on every rank
        full = torch.empty(shape, dtype=dtype, device=self.device)
        if self.rank == 0:
            value = self.state[_find(names, self.state)]
            if tuple(value.shape) != tuple(shape):
                raise CheckpointFormatError(f"{names[0]}: the checkpoint's tensor has shape {tuple(value.shape)}, "
                                            f"the model's parameter {tuple(shape)}")
            full.copy_(value)
        self.collectives.broadcast(full, src=0)
        rows = full.reshape(1) if len(shape) == 0 else full[start:stop]
        self.elements_read += rows.numel()
        return rows.cpu()

    def full(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """One whole tensor (for buffers), shaped and typed like ``like``."""
        out = like.detach().to(self.device).clone()
        if self.rank == 0:
            out.copy_(self.state[name])
        self.collectives.broadcast(out, src=0)
        return out.to(like.device)

    def close(self) -> None:
        self.state.clear()


class _Counted:
    """A row reader that moves a progress bar by the bytes of the rows it returns."""

    def __init__(self, reader: Any, bar: Any) -> None:
        self.reader, self.bar = reader, bar

    def __call__(self, names: list[str], start: int, stop: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        rows = self.reader(names, start, stop, shape, dtype)
        self.bar.update(rows.numel() * rows.element_size())
        return rows


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # files in the legacy (non-zip) format cannot be memory-mapped
        return torch.load(file, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------------------------------- building
def resolve_dtype(dtype: str | torch.dtype | None, config: Any) -> torch.dtype:
    """The parameters' dtype: a torch dtype, its name, ``"auto"`` (the config's ``dtype``) or None (fp32)."""
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype: use e.g. 'float32', "
                             "'bfloat16' or 'auto' (the dtype in the folder's config.json)")
        return resolved
    return dtype


def build_on_meta(model_cls: Any, config: Any, dtype: torch.dtype, **model_kwargs: Any) -> nn.Module:
    """The model with its parameters on the meta device and its buffers real (see materialize.py).

    ``model_cls`` is an Auto class (``AutoModelForCausalLM``), a ``PreTrainedModel`` subclass or any
    ``nn.Module`` class taking the config.
    """
    with meta_parameters():
        if hasattr(model_cls, "from_config"):
            model = model_cls.from_config(config, dtype=dtype, **model_kwargs)
        elif hasattr(model_cls, "_from_config"):
            model = model_cls._from_config(config, dtype=dtype, **model_kwargs)
        else:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = model_cls(config, **model_kwargs)
            finally:
                torch.set_default_dtype(previous)
    return model


def persistent_buffers(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Qualified name -> (owner, attribute) of every buffer that ``state_dict`` saves."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = (sub, name)
    return out


def _load_buffers(module: nn.Module, reader: Any, available: Any) -> None:
    for name, (owner, attr) in persistent_buffers(module).items():
        current = owner._buffers[attr]
        assert current is not None  # persistent_buffers() names set buffers only
        if isinstance(reader, BroadcastRows):
            if reader.has([name]):
                owner._buffers[attr] = reader.full(name, current)
        elif name in available:
            owner._buffers[attr] = reader.full(name).to(dtype=current.dtype)


def _load_generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)


def from_pretrained_sharded(
    model_cls: Any,
    path: str | os.PathLike,
    target: Any,
    options: ShardingOptions | None = None,
    *,
    dtype: str | torch.dtype | None = torch.float32,
    **model_kwargs: Any,
) -> ShardedModel:
    """Build ``model_cls`` from the local folder ``path`` and load its weights shard by shard.

    Args:
        model_cls: ``AutoModelForCausalLM`` (or any Auto class), a ``PreTrainedModel`` subclass, or
            an ``nn.Module`` class taking the config.
        path: a folder written by ``save_pretrained`` (config.json + safetensors, or .bin files).
        target: an ``xshard.Accelerator`` (its sharding options are used and the model is prepared
            with it, so ``acc.prepare(model, optimizer, ...)`` afterwards works) or a ``Backend``.
        options: sharding options (default: the accelerator's, else ``ShardingOptions()``).
            Loaded without ``sync_module_states``: every rank reads the same checkpoint.
        dtype: the parameters' dtype (the fp32 master weights by default); ``"auto"`` takes the
            config's, as ``from_pretrained`` does.
        **model_kwargs: passed to the model's constructor (e.g. ``attn_implementation="sdpa"``).

    Every rank must call it. Returns the ``ShardedModel`` in eval mode, as ``from_pretrained`` does.
    """
    from transformers import AutoConfig

    folder = Path(path)
    kind, files = checkpoint_files(folder)
    accelerator = target if hasattr(target, "sharding_options") else None
    backend = accelerator.backend if accelerator is not None else target
    if options is None:
        options = accelerator.sharding_options(weights_from_checkpoint=True) if accelerator is not None else \
            ShardingOptions()
    # every rank reads the same checkpoint, so nothing is broadcast (a copy: the caller's options stay as given)
    options = dataclasses.replace(options, sync_module_states=False)

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = build_on_meta(model_cls, config, resolve_dtype(dtype, config), **model_kwargs)
    total = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    _load_generation_config(model, folder)
    collectives = backend.collectives
    if kind == "safetensors":
        reader: Any = SafetensorsRows(files)
    else:
        log.info("%s has only .bin weights, which cannot be read by rows: rank 0 loads them and broadcasts one "
                 "tensor at a time (save the model with save_pretrained to get safetensors)", folder)
        reader = BroadcastRows(files, collectives, backend.device())
    try:
        _load_buffers(model, reader, files)
        plan = ShardingPlan.from_options(options, collectives.world_size, backend.world.local_world_size)
        with slow_progress(f"loading {folder.name}") as bar:
            if not plan.shard_parameters:  # replicated: whole tensors
                fill_parameters(model, _Counted(reader, bar))
                sharded = shard_model(model, backend, options)
            else:
                sharded = shard_model(model, backend, options)
                fill_shards(sharded, _Counted(reader, bar))
    finally:
        reader.close()
    sharded.eval()
    log.info("loaded %s from %s (%s): %d of %d parameter elements read by this rank", type(model).__name__,
             folder, kind, reader.elements_read, total)
    if accelerator is not None:
        accelerator.prepare_model(sharded)
    return sharded
