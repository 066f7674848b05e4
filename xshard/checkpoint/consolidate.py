"""Consolidate an xshard checkpoint (full, sharded or local) into one state dict, with no process group.

The output's name says what it is: a name ending in ``.safetensors`` is that one file (the state
dict); any other name is a folder holding ``model.safetensors`` and, when the checkpoint has the
model's ``config.json`` (transformers models), that too, so ``from_pretrained`` loads the folder.
Every file is checked against the checkpoint's manifest (size, checksum) while it is read, and the
output file appears whole or not at all: it is written beside its name and renamed in, so a kill never leaves
a half file under the name, and the partial file of an earlier killed run (this user's, its process gone) is
removed. An existing output is never replaced unless ``overwrite`` is asked for, and only a committed checkpoint
is read (a save's unfinished ``.tmp`` folder is refused, naming the last complete checkpoint beside it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..runtime.rank_logging import get_logger
from ..sharding.layout import rows_of
from .files import (
    DELETED_SUFFIX,
    MANIFEST,
    OLD_SUFFIX,
    SAVING_MARKER,
    TMP_SUFFIX,
    CheckpointError,
    complete_checkpoints,
    read_manifest,
    verify_file,
)
from .formats import RowReader
from .progress import slow_progress
from .tensorfile import PT_METADATA, HashingFile, atomic_path, remove_stale_partials, write_safetensors

log = get_logger("xshard.checkpoint")

WEIGHTS = "model.safetensors"


def _model_table(folder: Path, manifest: dict[str, Any], model_index: int) -> dict[str, dict[str, Any]]:
    """The manifest's row table of model ``model_index`` (key -> its entry; a tied name's entry says ``same_as``)."""
    table: dict[str, dict[str, Any]] | None = manifest.get("tables", {}).get(f"model{model_index}")
    if table is None:
        raise CheckpointError(f"{folder / MANIFEST}: key 'tables' has no 'model{model_index}' "
                              f"(the job saved {manifest.get('models', 0)} model(s))")
    return table


def consolidated_state_dict(checkpoint: str | os.PathLike[str], model_index: int = 0) -> dict[str, torch.Tensor]:
    """The full state dict of model ``model_index`` of a checkpoint, assembled from its row pieces: every key,
    a tied weight's names all the same tensor (read once)."""
    folder = Path(checkpoint)
    manifest = read_manifest(folder)
    table = _model_table(folder, manifest, model_index)
    with slow_progress(f"reading {folder.name}") as bar:
        reader = RowReader(folder, manifest, bar.update)
        out: dict[str, torch.Tensor] = {}
        for key in sorted(table, key=lambda k: "same_as" in table[k]):  # each tie's first name before its others
            entry = table[key]
            if "same_as" in entry:
                first = key
                while "same_as" in table[first]:
                    first = str(table[first]["same_as"])
                out[key] = out[first]
                continue
            shape = tuple(entry["shape"])
            out[key] = reader.rows(table, key, 0, rows_of(shape), f"model {model_index}").reshape(shape)
    return {key: out[key] for key in table}  # the checkpoint's order


def output_files(out: str | Path, overwrite: bool = False) -> tuple[Path | None, Path]:
    """(folder or None, weights file) that ``consolidate`` writes for the output name ``out``; an existing
    output is refused unless ``overwrite``."""
    target = Path(out)
    if target.suffix == ".safetensors":
        if target.is_dir():
            raise CheckpointError(f"{target} is a folder: give a new .safetensors file name, or a folder name "
                                  "without the .safetensors ending")
        _refuse_existing(target, overwrite)
        return None, target
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a folder: give a folder name, or a file name ending in "
                              ".safetensors for one state dict file")
    for name in (WEIGHTS, "config.json"):
        _refuse_existing(target / name, overwrite)
    return target, target / WEIGHTS


def _refuse_existing(path: Path, overwrite: bool) -> None:
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise CheckpointError(f"{path} exists: consolidate does not replace it; pass --overwrite to replace it, or "
                              "give another output name")


def _committed(folder: Path) -> None:
    """Refuse a folder a save has not committed (its ``.tmp``, ``.old``, a folder still being written)."""
    if folder.name.endswith((TMP_SUFFIX, OLD_SUFFIX, DELETED_SUFFIX)) or (folder / SAVING_MARKER).exists():
        done = [p for p in complete_checkpoints(folder.parent) if p != folder]
        last = f"; the last complete checkpoint there is {done[-1]}" if done else ""
        raise CheckpointError(f"{folder} is not a committed checkpoint (a save's work folder, which load_state "
                              f"skips as incomplete){last}")


def consolidate(checkpoint: str | Path, out: str | Path, model_index: int = 0, overwrite: bool = False) -> Path:
    """Write the consolidated weights to ``out`` (see the module docstring); returns the file written.
    ``overwrite``: replace an existing output (written beside it and renamed in)."""
    folder = Path(checkpoint)
    _committed(folder)
    export, weights = output_files(out, overwrite)
    manifest = read_manifest(folder)
    table = _model_table(folder, manifest, model_index)
    # a tied weight once, under its first name, as transformers' save_pretrained writes it (from_pretrained ties it)
    state = {key: t for key, t in consolidated_state_dict(folder, model_index).items() if "same_as" not in table[key]}
    config = verify_file(folder, "config.json", manifest) if "config.json" in manifest.get("files", {}) else None
    try:
        weights.parent.mkdir(parents=True, exist_ok=True)
        for leftover in remove_stale_partials(weights) + (remove_stale_partials(export / "config.json") if export
                                                          else []):
            log.info("removed %s, the partial file of an earlier consolidate that was stopped", leftover)
        if export is not None and model_index == 0 and config is not None:
            with atomic_path(export / "config.json") as tmp:
                shutil.copyfile(config, tmp)
        with slow_progress(f"writing {weights.name}") as bar, atomic_path(weights) as tmp, open(tmp, "wb") as f:
            write_safetensors(HashingFile(f, bar.update), state, PT_METADATA)
    except OSError as exc:
        raise CheckpointError(f"cannot write {weights}: {exc.strerror or exc}; pick another output path") from exc
    return weights
