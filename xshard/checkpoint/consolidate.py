"""Consolidate an xshard checkpoint (sharded, local or full) into one state dict, with no process group.

When the checkpoint holds the model's ``config.json`` (transformers models), the output is a folder
with ``config.json`` and ``model.safetensors`` that ``from_pretrained`` loads; otherwise it is one
``.safetensors`` file. Every file is checked against the checkpoint's manifest (size, sha256) while
it is read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..sharding.layout import rows_of
from .files import MANIFEST, CheckpointError, read_manifest, verify_file
from .formats import RowReader


def consolidated_state_dict(checkpoint: str | Path, model_index: int = 0) -> dict[str, torch.Tensor]:
    """The full state dict of model ``model_index`` of a checkpoint, assembled from its row pieces."""
    folder = Path(checkpoint)
    manifest = read_manifest(folder)
    table = manifest.get("tables", {}).get(f"model{model_index}")
    if table is None:
        raise CheckpointError(f"{folder / MANIFEST}: key 'tables' has no 'model{model_index}' "
                              f"(the job saved {manifest.get('models', 0)} model(s))")
    reader = RowReader(folder, manifest)
    out = {}
    for key, entry in table.items():
        while "same_as" in entry:
            entry = table[entry["same_as"]]
        shape = tuple(entry["shape"])
        out[key] = reader.rows(table, key, 0, rows_of(shape), f"model {model_index}").reshape(shape)
    return out


def consolidate(checkpoint: str | Path, out: str | Path, model_index: int = 0) -> Path:
    """Write the consolidated weights to ``out``; returns the file written (model.safetensors inside a
    folder when the checkpoint holds a transformers config.json)."""
    from safetensors.torch import save_file

    folder, target = Path(checkpoint), Path(out)
    state = consolidated_state_dict(folder, model_index)
    manifest = read_manifest(folder)
    if model_index == 0 and "config.json" in manifest.get("files", {}):
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(verify_file(folder, "config.json", manifest), target / "config.json")
        target = target / "model.safetensors"
    elif target.is_dir() or target.suffix != ".safetensors":
        raise CheckpointError(f"{target}: the checkpoint's model has no config.json (not a transformers model), so "
                              "the output is one state dict: give a file name ending in .safetensors")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target), metadata={"format": "pt"})
    return target
