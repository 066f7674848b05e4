"""Files of a checkpoint: atomic folders, fsync, checksums, the manifest, finding the latest one.

A checkpoint is complete exactly when its folder has its final name and holds ``xshard_state.json``
(the manifest). Every rank writes into ``<name>.tmp``; the manifest is written last, by rank 0,
after all ranks finished their files; then rank 0 renames the folder into place. A crash at any
point leaves either the previous checkpoint or a ``.tmp`` folder that nothing loads. Rotation
renames a doomed checkpoint to ``<name>.deleted`` before deleting it, so a crash mid-delete never
leaves a half-deleted folder that looks complete.

Every file is created with ``open`` (the user's umask applies to all of them alike) and hashed as
it is written (``tensorfile.HashingFile``), so a save reads nothing back.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..backends.errors import XShardError
from .tensorfile import HashingFile, write_safetensors

MANIFEST = "xshard_state.json"
#: 3: "full" checkpoints store the optimizer by rows (they reshard); 2 is still read
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
DELETED_SUFFIX = ".deleted"
_NOT_FINAL = (TMP_SUFFIX, OLD_SUFFIX, DELETED_SUFFIX)
#: test hook: a rank exits abruptly (as if killed) after writing this many files of a checkpoint
FAIL_AFTER_ENV = "XSHARD_TEST_FAIL_SAVE_AFTER"
FAIL_RANK_ENV = "XSHARD_TEST_FAIL_SAVE_RANK"


class CheckpointError(XShardError, ValueError):
    """A checkpoint cannot be loaded: missing, truncated, corrupted, or from another model or job."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was written by a job that does not match this one (world size, stage, objects)."""


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names) to disk, where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (``on_bytes`` hears of each block's size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            if on_bytes is not None:
                on_bytes(len(block))
    return h.hexdigest()


class FileWriter:
    """Writes one rank's files into a checkpoint folder and remembers their size and checksum.

    ``on_bytes`` (e.g. a progress bar's ``update``) hears of every block written.
    """

    def __init__(self, folder: Path, rank: int, on_bytes: Callable[[int], None] | None = None) -> None:
        self.folder = folder
        self.rank = rank
        self.on_bytes = on_bytes
        self.files: dict[str, dict[str, Any]] = {}
        fail = os.environ.get(FAIL_AFTER_ENV)
        fail_rank = os.environ.get(FAIL_RANK_ENV)
        applies = fail is not None and (fail_rank is None or int(fail_rank) == rank)
        self._fail_after = int(fail) if applies else None

    def _write(self, name: str, write: Callable[[HashingFile], None]) -> None:
        with open(self.folder / name, "wb") as f:
            out = HashingFile(f, self.on_bytes)
            write(out)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {"bytes": out.bytes, "sha256": out.hexdigest()}
        if self._fail_after is not None and len(self.files) >= self._fail_after:
            # Half a file too, as a killed writer would leave it.
            (self.folder / f"partial.rank{self.rank}.safetensors").write_bytes(b"\0" * 16)
            os._exit(17)

    def safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        """Write tensors as a safetensors file (tied tensors are simply written under each name)."""
        self._write(name, lambda out: write_safetensors(out, tensors, metadata or {"format": "pt"}))

    def torch(self, name: str, obj: Any) -> None:
        """Write plain data and tensors with ``torch.save`` (loaded back with ``weights_only=True``)."""
        self._write(name, lambda out: torch.save(obj, out))

    def text(self, name: str, text: str) -> None:
        """Write a text file (e.g. a model's config.json)."""
        self._write(name, lambda out: out.write(text.encode("utf-8")))


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest (last file of a checkpoint) and fsync it."""
    with open(folder / MANIFEST, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())


def near_name(folder: Path) -> str:
    """For a folder that does not exist: " (did you mean '<sibling>'?)" naming a close existing one, or ""."""
    parent = folder.parent
    if not parent.is_dir():
        return ""
    close = difflib.get_close_matches(folder.name, [p.name for p in parent.iterdir() if p.is_dir()], n=1)
    return f" (did you mean {str(parent / close[0])!r}?)" if close else ""


def missing_checkpoint_message(folder: Path) -> str:
    """Why ``folder`` is no checkpoint, and what to pass instead: a near name, or a checkpoint inside it."""
    if not folder.is_dir():
        return f"{folder}: no such checkpoint folder{near_name(folder)}"
    inside = complete_checkpoints(folder)
    if inside:
        return (f"{folder} holds checkpoints but is not one: pass the folder of one (the newest is {inside[-1]}), "
                "or resume_from_checkpoint=True to load the newest")
    return (f"{folder} is not a complete xshard checkpoint: {MANIFEST} is missing (a save that did not finish "
            "leaves no manifest); load another checkpoint")


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint, or a CheckpointError saying what is wrong."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(missing_checkpoint_message(folder))
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt ({exc}); load another checkpoint") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: key 'format_version' is {version!r}, this xshard reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}; consolidate it with the xshard that wrote it")
    return manifest


def verify_file(folder: Path, name: str, manifest: dict[str, Any],
                on_bytes: Callable[[int], None] | None = None) -> Path:
    """Check ``name`` against the manifest's size and sha256 before anything reads it."""
    path = folder / name
    entry = manifest.get("files", {}).get(name)
    if entry is None:
        raise CheckpointError(f"{path}: the manifest ({MANIFEST}) has no key files[{name!r}]: the checkpoint "
                              "is incomplete or was edited")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (listed in {MANIFEST} under files[{name!r}])")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} is truncated or overwritten: {size} bytes, {MANIFEST} files[{name!r}] "
                              f"says {entry['bytes']}; load another checkpoint")
    if sha256(path, on_bytes) != entry["sha256"]:
        raise CheckpointError(f"{path} is corrupted: its sha256 does not match {MANIFEST} files[{name!r}]; "
                              "load another checkpoint")
    return path


def load_torch(folder: Path, name: str, manifest: dict[str, Any],
               on_bytes: Callable[[int], None] | None = None) -> Any:
    """``torch.load(weights_only=True)`` of a verified file (no code from the file can run)."""
    path = verify_file(folder, name, manifest, on_bytes)
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read safely ({exc})") from exc


# ---------------------------------------------------------------------- folders


def begin(final: Path, is_main: bool) -> Path:
    """The temporary folder a save writes into (rank 0 creates it empty)."""
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, final: Path) -> None:
    """Rank 0, after every rank finished and the manifest is written: move the folder into place.

    An older checkpoint of the same name is moved aside first and deleted only after the rename,
    so some complete checkpoint exists at every instant (``load_state`` falls back to ``.old``).
    """
    fsync_dir(tmp)
    old = final.with_name(final.name + OLD_SUFFIX)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def is_complete(folder: Path) -> bool:
    """True for a folder with its final name and a manifest."""
    return folder.is_dir() and not folder.name.endswith(_NOT_FINAL) and (folder / MANIFEST).is_file()


_NUMBER = re.compile(r"(\d+)$")


def _order(folder: Path) -> tuple[int, int, float]:
    try:
        step = int(json.loads((folder / MANIFEST).read_text()).get("step", -1))
    except (OSError, ValueError):
        step = -1
    number = _NUMBER.search(folder.name)
    return step, int(number.group(1)) if number else -1, (folder / MANIFEST).stat().st_mtime


def _looks_unfinished(folder: Path) -> bool:
    """A save's temporary folder, or a folder of checkpoint files without a manifest."""
    if folder.name.endswith(TMP_SUFFIX):
        return True
    return not folder.name.endswith((OLD_SUFFIX, DELETED_SUFFIX)) and any(folder.glob("*.safetensors"))


def complete_checkpoints(output_dir: str | os.PathLike, warn: bool = False) -> list[Path]:
    """Complete checkpoints directly under ``output_dir``, oldest first (by step, then name number,
    then time). With ``warn``, each incomplete one (a save that did not finish) is named in a warning."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        if is_complete(child):
            found.append(child)
        elif warn and _looks_unfinished(child):
            warnings.warn(f"skipping incomplete checkpoint {child} (its save did not finish)", stacklevel=3)
    return sorted(found, key=_order)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``output_dir`` (None if there is none); incomplete ones
    (a save that crashed) are skipped with a warning."""
    found = complete_checkpoints(output_dir, warn=True)
    return found[-1] if found else None


def rotate(output_dir: Path, keep: int, newest: Path) -> list[Path]:
    """Delete the oldest complete checkpoints under ``output_dir`` so that ``keep`` remain; ``newest``
    (the one just saved) is never deleted. Returns what was deleted."""
    if keep < 1:
        raise ValueError(f"save_total_limit={keep}: keep at least 1 checkpoint (or None for no rotation)")
    found = [p for p in complete_checkpoints(output_dir) if p.resolve() != newest.resolve()]
    doomed = found[: max(0, len(found) + 1 - keep)]
    for path in doomed:
        remove_folder(path)
    for leftover in output_dir.glob(f"*{DELETED_SUFFIX}"):  # a deletion that a crash interrupted
        remove_folder(leftover)
    return doomed


def remove_folder(path: Path) -> None:
    """Delete a checkpoint folder: renamed out of the way first (one atomic step), then removed."""
    doomed = path if path.name.endswith(DELETED_SUFFIX) else path.with_name(path.name + DELETED_SUFFIX)
    if doomed != path:
        if doomed.exists():
            shutil.rmtree(doomed)
        path.rename(doomed)
    shutil.rmtree(doomed)
