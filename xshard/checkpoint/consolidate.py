"""Consolidate an xshard checkpoint (full, sharded or local) into one state dict, with no process group.

The output's name says what it is: a name ending in ``.safetensors`` is that one file (the state
dict); any other name is a folder holding ``model.safetensors`` and, when the checkpoint has the
model's ``config.json`` (transformers models), that too, so ``from_pretrained`` loads the folder.
Every file is checked against the checkpoint's manifest (size, checksum) while it is read, and the
output file appears whole or not at all.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..sharding.layout import rows_of
from .files import MANIFEST, CheckpointError, read_manifest, verify_file
from .formats import RowReader
from .progress import slow_progress
from .tensorfile import PT_METADATA, HashingFile, atomic_path, write_safetensors

WEIGHTS = "model.safetensors"


def consolidated_state_dict(checkpoint: str | os.PathLike[str], model_index: int = 0) -> dict[str, torch.Tensor]:
    """The full state dict of model ``model_index`` of a checkpoint, assembled from its row pieces."""
    folder = Path(checkpoint)
    manifest = read_manifest(folder)
    table = manifest.get("tables", {}).get(f"model{model_index}")
    if table is None:
        raise CheckpointError(f"{folder / MANIFEST}: key 'tables' has no 'model{model_index}' "
                              f"(the job saved {manifest.get('models', 0)} model(s))")
    with slow_progress(f"reading {folder.name}") as bar:
        reader = RowReader(folder, manifest, bar.update)
        out = {}
        for key, entry in table.items():
            while "same_as" in entry:
                entry = table[entry["same_as"]]
            shape = tuple(entry["shape"])
            out[key] = reader.rows(table, key, 0, rows_of(shape), f"model {model_index}").reshape(shape)
    return out


def output_files(out: str | Path) -> tuple[Path | None, Path]:
    """(folder or None, weights file) that ``consolidate`` writes for the output name ``out``."""
    target = Path(out)
    if target.suffix == ".safetensors":
        if target.is_dir():
            raise CheckpointError(f"{target} is a folder: give a new .safetensors file name, or a folder name "
                                  "without the .safetensors ending")
        return None, target
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a folder: give a folder name, or a file name ending in "
                              ".safetensors for one state dict file")
    return target, target / WEIGHTS


def consolidate(checkpoint: str | Path, out: str | Path, model_index: int = 0) -> Path:
    """Write the consolidated weights to ``out`` (see the module docstring); returns the file written."""
    folder = Path(checkpoint)
    export, weights = output_files(out)
    manifest = read_manifest(folder)
    state = consolidated_state_dict(folder, model_index)
    config = verify_file(folder, "config.json", manifest) if "config.json" in manifest.get("files", {}) else None
    try:
        weights.parent.mkdir(parents=True, exist_ok=True)
        if export is not None and model_index == 0 and config is not None:
            with atomic_path(export / "config.json") as tmp:
                shutil.copyfile(config, tmp)
        with slow_progress(f"writing {weights.name}") as bar, atomic_path(weights) as tmp, open(tmp, "wb") as f:
            write_safetensors(HashingFile(f, bar.update), state, PT_METADATA)
    except OSError as exc:
        raise CheckpointError(f"cannot write {weights}: {exc.strerror or exc}; pick another output path") from exc
    return weights
