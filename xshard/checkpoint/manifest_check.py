"""The shape of a checkpoint's manifest, checked before anything of the checkpoint is read or applied.

A manifest is data from disk: a file edited by hand, a copy from elsewhere, a crafted folder. Every
value a load uses is checked here first, so that a bad one is a ``CheckpointError`` naming the key
(and the checkpoint falls back to an older one under ``resume_from_checkpoint=True``), never a bare
``ValueError`` halfway through putting the state into the job. File names must be plain names of
files inside the folder: a name with ``..``, a separator or an absolute path would let a manifest
point the load (or ``xshard consolidate``) at any file on the machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .checksum import WRITTEN, algorithm_of


def is_plain_name(name: str) -> bool:
    """A file name inside one folder: no separator, no ``..``, not absolute, not empty."""
    return (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name
            and not os.path.isabs(name) and Path(name).name == name)


#: the largest count a manifest may hold: what a 64-bit signed integer (a tensor, a C counter) holds
MAX_COUNT = 2**63 - 1


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _table_entry(entry: Any) -> bool:
    """A row-table entry as a save writes it: a tied key's ``same_as``, or shape, dtype and row pieces."""
    if not isinstance(entry, dict):
        return False
    if "same_as" in entry:
        return isinstance(entry["same_as"], str)
    shape, pieces = entry.get("shape"), entry.get("pieces")
    return (isinstance(shape, list) and all(_count(n) for n in shape) and isinstance(entry.get("dtype"), str)
            and isinstance(pieces, list)
            and all(isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and _count(p[1]) and _count(p[2])
                    and p[1] <= p[2] for p in pieces))


def check_manifest(path: Path, manifest: Any, error: type[Exception]) -> None:
    """Raise ``error`` naming ``path`` and the key when the manifest's values are not what a save writes."""
    if not isinstance(manifest, dict):
        raise error(f"{path} holds a {type(manifest).__name__}, not a manifest; load another checkpoint")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise error(f"{path}: key 'files' is {files!r}, expected a mapping of file names; load another checkpoint")
    for name, entry in files.items():
        if not is_plain_name(name):
            raise error(f"{path}: files[{name!r}] is not a plain file name inside the checkpoint folder (no '..', "
                        "no '/', no absolute path); the manifest was edited or crafted: load another checkpoint")
        if not isinstance(entry, dict) or not _count(entry.get("bytes")) or algorithm_of(entry) is None:
            raise error(f"{path}: files[{name!r}] is {entry!r}, expected {{'bytes': <size>, '{WRITTEN}': <32 hex "
                        "digits>} (or 'sha256': <64 hex digits> before format 4); load another checkpoint")
    for key in ("step", "micro_step", "world_size", "models", "optimizers", "schedulers", "data_loaders"):
        if key in manifest and not _count(manifest[key]):
            raise error(f"{path}: key {key!r} is {manifest[key]!r}, expected a whole number from 0 to {MAX_COUNT}; "
                        "the manifest was edited: load another checkpoint")
    if manifest.get("world_size", 1) == 0:
        raise error(f"{path}: key 'world_size' is 0, expected the number of processes that saved (at least 1); the "
                    "manifest was edited: load another checkpoint")
    stage = manifest.get("stage")
    if stage is not None and (not _count(stage) or stage > 3):
        raise error(f"{path}: key 'stage' is {stage!r}, expected 0, 1, 2 or 3; the manifest was edited: load another "
                    "checkpoint")
    for key in ("tables", "config"):
        if key in manifest and not isinstance(manifest[key], dict):
            raise error(f"{path}: key {key!r} is {manifest[key]!r}, expected a mapping; load another checkpoint")
    tables = manifest.get("tables", {})
    for table_name, table in tables.items():
        if not isinstance(table, dict):
            raise error(f"{path}: tables[{table_name!r}] is {table!r}, expected a mapping; load another checkpoint")
        for key, entry in table.items():
            if not _table_entry(entry):
                raise error(f"{path}: tables[{table_name!r}][{key!r}] is {str(entry)[:200]}, expected "
                            "{'shape': [<sizes>], 'dtype': <name>, 'pieces': [[<file>, <first row>, <end row>], ...]} "
                            "or {'same_as': <key>}; the manifest was edited: load another checkpoint")
