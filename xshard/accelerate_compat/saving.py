"""Writing weights for other programs: ``Accelerator.save`` and ``Accelerator.save_model``.

``save_model`` writes what transformers writes: ``model.safetensors``, or, past ``max_shard_size``,
``model-00001-of-00003.safetensors`` ... with ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``), so ``from_pretrained`` and
``safetensors`` read the folder. ``safe_serialization=False`` writes ``pytorch_model*.bin`` the same
way. Tensors that share memory (tied weights) are written once, under their first key, as
transformers does (it re-ties them on load). Shard files of an earlier save that this save does
not overwrite are removed, so the folder never mixes two saves.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SHARD_FILE = re.compile(r"^(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)$")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "10GB", "500MB", "2GiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B)\s*", str(size).upper())
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: use bytes (an int) or a string such as '10GB' or '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def save_object(obj: Any, path: str | os.PathLike, safe_serialization: bool = False) -> None:
    """``torch.save(obj, path)``, or with ``safe_serialization`` a safetensors file of a dict of tensors."""
    if safe_serialization:
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise TypeError("save(..., safe_serialization=True) writes safetensors, which hold a dict of tensors "
                            f"only; got {type(obj).__name__}: use safe_serialization=False for other objects")
        from ..checkpoint.tensorfile import PT_METADATA, atomic_path, write_safetensors

        # one tensor at a time (tied tensors written once per key, as safetensors needs); a crash
        # leaves any earlier file at ``path`` as it was
        with atomic_path(Path(path)) as tmp, open(tmp, "wb") as file:
            write_safetensors(file, obj, PT_METADATA)
    else:
        torch.save(obj, path)


def drop_shared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one key per block of shared memory (tied weights: the first key)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for key, tensor in state_dict.items():
        ident = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if tensor.numel() and ident in seen:
            continue
        seen.add(ident)
        out[key] = tensor
    return out


def plan_shards(state_dict: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys grouped in order into files of at most ``max_bytes`` (a larger tensor gets its own file)."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def write_model(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                safe_serialization: bool = True) -> list[Path]:
    """Write a full state dict as transformers does (see the module docstring); returns the files."""
    folder = Path(directory)
    if folder.is_file():
        raise ValueError(f"save_model: {folder} is a file; give a folder")
    folder.mkdir(parents=True, exist_ok=True)
    state = drop_shared({k: v.detach().cpu().contiguous() for k, v in state_dict.items()})
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    groups = plan_shards(state, parse_size(max_shard_size))
    if len(groups) == 1:
        names = [f"{stem}.{ext}"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}" for i in range(len(groups))]
    for old in folder.iterdir():
        if _SHARD_FILE.match(old.name) and old.name not in names:
            old.unlink()
    written = []
    for name, keys in zip(names, groups, strict=True):
        save_object({k: state[k] for k in keys}, folder / name, safe_serialization)
        written.append(folder / name)
    index = folder / f"{stem}.{ext}.index.json"
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        weight_map = {k: name for name, keys in zip(names, groups, strict=True) for k in keys}
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                    indent=2, sort_keys=True) + "\n")
        written.append(index)
    elif index.exists():
        index.unlink()
    return written
