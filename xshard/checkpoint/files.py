"""Files of a checkpoint: atomic folders, fsync, checksums, the manifest, finding the latest one.

A checkpoint is complete exactly when its folder has its final name and holds ``xshard_state.json``
(the manifest). Every rank writes into ``<name>.tmp``; the manifest is written last, by rank 0,
after all ranks finished their files; then rank 0 renames the folder into place. A crash at any
point leaves either the previous checkpoint or a ``.tmp`` folder that nothing loads. Rotation
renames a doomed checkpoint to ``<name>.deleted`` before deleting it, so a crash mid-delete never
leaves a half-deleted folder that looks complete.

Files xshard did not write are never deleted or overwritten. A save into a folder that already
exists (the user's logs, TensorBoard runs, an older checkpoint of the same name) moves its files in
one by one beside the others, under a journal (``.xshard_pending.json``) that names the files that
are xshard's, and refuses, before writing anything, a folder holding a file of one of the
checkpoint's names that xshard did not write. An older checkpoint in that folder stays loadable
during the swap as ``<name>.old`` (hard links: no copy). Rotation considers only the numbered
folders of the series just saved (``checkpoint-<n>``) that hold a manifest, deletes only the files
a manifest lists, and keeps a folder that holds anything else. A symbolic link in the series (to a
checkpoint kept elsewhere) is the user's: rotation never counts it, renames it or deletes through it.

Every file is created with ``open`` (the user's umask applies to all of them alike), written around
the page cache where the filesystem allows it (``direct_io.py``: why and how) and hashed as it is
written (``tensorfile.HashingFile``; the algorithm and why: ``checksum.py``), so a save reads nothing
back.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import torch

from ..errors import XShardError
from . import checksum, direct_io
from .manifest_check import check_manifest, is_plain_name
from .tensorfile import PT_METADATA, HashingFile, write_bytes, write_safetensors

MANIFEST = "xshard_state.json"
#: 4: files are checksummed with xxh3-128 (checksum.py); 3: "full" checkpoints store the optimizer by
#: rows (they reshard); 2 and 3 (sha256) are still read
FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
DELETED_SUFFIX = ".deleted"
_NOT_FINAL = (TMP_SUFFIX, OLD_SUFFIX, DELETED_SUFFIX)
#: in a folder being committed into: the names that are xshard's (a crash mid-commit leaves it)
PENDING = ".xshard_pending.json"
#: in a ``.tmp`` folder while ranks write into it (what makes a leftover ``.tmp`` xshard's to remove)
SAVING_MARKER = ".xshard_saving"
#: every name a save writes into a checkpoint folder
CHECKPOINT_FILE = re.compile(
    r"^(xshard_state\.json|config\.json|(scheduler|data|scaler)\.pt|rng\.rank\d+\.pt|custom_checkpoint_\d+\.pt"
    r"|optimizer\.groups\.pt|(model|optimizer)(_\d+)?(\.rank\d+)?\.(safetensors|pt))$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(XShardError, ValueError):
    """A checkpoint cannot be loaded: missing, truncated, corrupted, or from another model or job."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was written by a job that does not match this one (world size, stage, objects)."""


class CheckpointSaveError(XShardError, OSError):
    """A checkpoint cannot be written where asked (the disk is full, a file of the user's is in the way);
    nothing of it was left behind and earlier checkpoints are intact."""


class _Discard:
    """A sink that keeps nothing: counts the bytes a file would take once the disk is full."""

    def write(self, data: Any) -> int:
        return len(memoryview(data).cast("B"))

    def flush(self) -> None:
        pass


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


class FileWriter:
    """Writes one rank's files into a checkpoint folder and remembers their size and checksum.

    ``on_bytes`` (e.g. a progress bar's ``update``) hears of every block written. When the disk fills
    up, the file is removed, ``no_space`` keeps the error and every later file is only counted
    (``bytes_needed``), so that this rank still takes part in every collective of the save and the
    message can say how much the checkpoint needs. A ``writer.Writer``.
    """

    counts_only = False

    def __init__(self, folder: Path, rank: int, on_bytes: Callable[[int], None] | None = None) -> None:
        self.folder = folder
        self.rank = rank
        self.on_bytes = on_bytes
        self.files: dict[str, dict[str, Any]] = {}
        self.no_space: OSError | None = None
        self.bytes_needed = 0

    def _write(self, name: str, write: Callable[[HashingFile], object]) -> None:
        if self.no_space is None:
            try:
                with open(self.folder / name, "wb", buffering=0, opener=direct_io.opener) as f:
                    blocks = direct_io.BlockWriter(f)  # around the page cache where it can: direct_io.py
                    out = HashingFile(blocks, self.on_bytes)
                    write(out)
                    blocks.finish()
                    os.fsync(f.fileno())
            except OSError as exc:
                if exc.errno not in _NO_SPACE:
                    raise
                self.no_space = exc
                (self.folder / name).unlink(missing_ok=True)
        if self.no_space is not None:
            out = HashingFile(_Discard())
            write(out)
            self.bytes_needed += out.bytes
            return
        self.bytes_needed += out.bytes
        self.files[name] = {"bytes": out.bytes, checksum.WRITTEN: out.hexdigest()}

    def safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] = PT_METADATA) -> None:
        """Write tensors as a safetensors file (tied tensors are simply written under each name)."""
        self._write(name, lambda out: write_safetensors(out, tensors, metadata))

    def image(self, name: str, data: torch.Tensor) -> None:
        """Write a file whose exact bytes are already in host memory (a flat uint8 CPU tensor): an async
        save's staged safetensors file. Written without a copy where ``data`` is page-aligned."""
        self._write(name, lambda out: write_bytes(out, data))

    def torch(self, name: str, obj: Any) -> None:
        """Write plain data and tensors with ``torch.save`` (loaded back with ``weights_only=True``)."""
        # HashingFile is a binary file object (write, flush), which is all torch.save uses
        self._write(name, lambda out: torch.save(obj, cast(IO[bytes], out)))

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
    if not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{path} leads outside the checkpoint folder (a link to {path.resolve()}): every file "
                              "a checkpoint is read from must lie inside its folder; load another checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt ({exc}); load another checkpoint") from exc
    except RecursionError as exc:  # a crafted manifest nested deeper than Python's stack
        raise CheckpointError(f"{path} is not a manifest (its JSON is nested too deeply to read); load another "
                              "checkpoint") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: key 'format_version' is {version!r}, this xshard reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}; consolidate it with the xshard that wrote it")
    check_manifest(path, manifest, CheckpointError)
    return manifest


def verify_file(folder: Path, name: str, manifest: dict[str, Any],
                on_bytes: Callable[[int], None] | None = None) -> Path:
    """Check ``name`` against the manifest's size and checksum before anything reads it."""
    path = folder / name
    entry = manifest.get("files", {}).get(name)
    if entry is None:
        raise CheckpointError(f"{path}: the manifest ({MANIFEST}) has no key files[{name!r}]: the checkpoint "
                              "is incomplete or was edited")
    if not is_plain_name(name) or not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{folder / MANIFEST}: files[{name!r}] leads outside the checkpoint folder (a '..', "
                              "an absolute path or a link out of it); refused: load another checkpoint")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (listed in {MANIFEST} under files[{name!r}])")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} is truncated or overwritten: {size} bytes, {MANIFEST} files[{name!r}] "
                              f"says {entry['bytes']}; load another checkpoint")
    algorithm = checksum.algorithm_of(entry)
    if algorithm is None:  # read_manifest refused such an entry already; a caller's own manifest may not be checked
        raise CheckpointError(f"{folder / MANIFEST}: files[{name!r}] names no checksum this xshard knows "
                              f"({', '.join(checksum.ALGORITHMS)}); load another checkpoint")
    if checksum.file_digest(path, algorithm, on_bytes) != entry[algorithm]:
        raise CheckpointError(f"{path} is corrupted: its {algorithm} checksum does not match {MANIFEST} "
                              f"files[{name!r}]; load another checkpoint")
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


def _listed(folder: Path) -> set[str]:
    """Names in ``folder`` that are xshard's: its manifest's files (and the manifest) and a pending
    commit's journal; only plain names of checkpoint files count, whatever a manifest says."""
    names: set[str] = set()
    for source, key in ((MANIFEST, "files"), (PENDING, "names")):
        try:
            data = json.loads((folder / source).read_text())
            listed = data.get(key, []) if isinstance(data, dict) else []
        except (OSError, ValueError, RecursionError):
            continue
        names.update(n for n in listed if isinstance(n, str) and is_plain_name(n) and CHECKPOINT_FILE.match(n))
        if source == MANIFEST:
            names.add(MANIFEST)
    return names


def _ours_to_replace(folder: Path) -> bool:
    """Whether a leftover ``.tmp`` / ``.old`` folder is one a save made (so xshard may remove it)."""
    if (folder / SAVING_MARKER).exists() or (folder / MANIFEST).is_file():
        return True
    return all(CHECKPOINT_FILE.match(p.name) or p.name.startswith("fragment.rank") for p in folder.iterdir())


def check_destination(final: Path) -> None:
    """Refuse, before anything is written, a save that would overwrite or delete a file of the user's.

    Every rank calls it (all see the same folder, which nothing changes before the save's first
    barrier), so all refuse together.
    """
    if final.exists() and not final.is_dir():
        raise CheckpointSaveError(f"cannot save a checkpoint to {final}: it is a file, not a folder; pass a folder "
                                  "(e.g. out/checkpoint-500)")
    for path in (final, final.with_name(final.name + TMP_SUFFIX), final.with_name(final.name + OLD_SUFFIX)):
        if path.is_symlink() and not path.resolve().is_relative_to(final.parent.resolve()):
            raise CheckpointSaveError(f"cannot save a checkpoint to {final}: {path} is a link to {path.resolve()}, "
                                      "outside the output folder, and a save never writes through it; remove the "
                                      "link or save elsewhere")
    for leftover in (final.with_name(final.name + TMP_SUFFIX), final.with_name(final.name + OLD_SUFFIX)):
        if leftover.is_dir() and not _ours_to_replace(leftover):
            raise CheckpointSaveError(f"cannot save a checkpoint to {final}: {leftover} exists and holds files xshard "
                                      "did not write (a save uses that name for its work); rename it or save elsewhere")
    if not final.is_dir():
        return
    ours = _listed(final)
    theirs = sorted(p.name for p in final.iterdir() if CHECKPOINT_FILE.match(p.name) and p.name not in ours)
    if theirs:
        raise CheckpointSaveError(
            f"cannot save a checkpoint to {final}: it holds {', '.join(theirs)}, which xshard did not write and a "
            "checkpoint would overwrite; save the checkpoint to its own folder (e.g. "
            f"{final / 'checkpoint-500'}) or move those files")


def begin(final: Path, is_main: bool) -> Path:
    """The temporary folder a save writes into (rank 0 creates it empty, marked as a save's)."""
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        (tmp / SAVING_MARKER).touch()
    return tmp


def commit(tmp: Path, final: Path) -> None:
    """Rank 0, after every rank finished and the manifest is written: move the checkpoint into place.

    A new folder is one rename. Into a folder that exists, the files move in one by one beside what
    is there (``_commit_into``); an older checkpoint of the same name stays complete as
    ``<name>.old`` until the new manifest is in place (``load_state`` falls back to it).
    """
    (tmp / SAVING_MARKER).unlink(missing_ok=True)
    fsync_dir(tmp)
    if not final.exists():
        tmp.rename(final)
        fsync_dir(final.parent)
        return
    _commit_into(tmp, final)


def _commit_into(tmp: Path, final: Path) -> None:
    new = sorted(p.name for p in tmp.iterdir())
    ours = _listed(final)
    theirs = [n for n in new if (final / n).exists() and n not in ours]
    if theirs:  # check_destination refused this before the save; a file appeared since
        raise CheckpointSaveError(f"cannot save a checkpoint to {final}: {', '.join(theirs)} appeared there during "
                                  f"the save and would be overwritten; the new checkpoint is left in {tmp}")
    backup = final.with_name(final.name + OLD_SUFFIX)
    if (final / MANIFEST).is_file():  # the checkpoint being replaced stays whole in .old during the swap
        if backup.exists():
            shutil.rmtree(backup)
        backup.mkdir()
        for name in sorted(ours - {MANIFEST}) + [MANIFEST]:
            if (final / name).is_file():
                _link_or_copy(final / name, backup / name)
        fsync_dir(backup)
    journal = final / PENDING
    with open(journal, "w", encoding="utf-8") as f:
        json.dump({"names": sorted(ours | set(new))}, f)
        f.flush()
        os.fsync(f.fileno())
    (final / MANIFEST).unlink(missing_ok=True)  # from here the folder is no checkpoint until the new manifest
    for name in sorted(ours - set(new)):
        (final / name).unlink(missing_ok=True)
    for name in new:
        if name != MANIFEST:
            os.replace(tmp / name, final / name)
    fsync_dir(final)
    os.replace(tmp / MANIFEST, final / MANIFEST)
    fsync_dir(final)
    journal.unlink()
    tmp.rmdir()
    if backup.exists():
        shutil.rmtree(backup)
    fsync_dir(final.parent)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


def is_complete(folder: Path) -> bool:
    """True for a folder with its final name and a manifest."""
    return folder.is_dir() and not folder.name.endswith(_NOT_FINAL) and (folder / MANIFEST).is_file()


def stand_in(folder: Path) -> Path | None:
    """``<name>.old`` when a crash mid-commit left ``folder`` without its manifest and the checkpoint it
    replaced whole there (see ``commit``); else None."""
    old = folder.with_name(folder.name + OLD_SUFFIX)
    return old if not (folder / MANIFEST).is_file() and (old / MANIFEST).is_file() else None


_NUMBER = re.compile(r"(\d+)$")


def _order(folder: Path) -> tuple[int, int, float]:
    # A manifest whose step cannot be read sorts as the newest: resuming tries it first, so its
    # error is named when the load falls back to the one before it.
    try:
        step = json.loads((folder / MANIFEST).read_text()).get("step", -1)
        step = step if isinstance(step, int) and not isinstance(step, bool) and step <= sys.maxsize else sys.maxsize
    except (OSError, ValueError, AttributeError, RecursionError):
        step = sys.maxsize
    number = _NUMBER.search(folder.name.removesuffix(OLD_SUFFIX))
    try:
        mtime = (folder / MANIFEST).stat().st_mtime
    except OSError:  # removed since it was listed (by hand, or by another job): sorts by the rest
        mtime = 0.0
    return step, int(number.group(1)) if number else -1, mtime


def _looks_unfinished(folder: Path) -> bool:
    """A save's temporary folder, or a folder of checkpoint files without a manifest."""
    if folder.name.endswith(TMP_SUFFIX):
        return True
    return not folder.name.endswith((OLD_SUFFIX, DELETED_SUFFIX)) and any(folder.glob("*.safetensors"))


def complete_checkpoints(output_dir: str | os.PathLike, warn: bool = False) -> list[Path]:
    """Complete checkpoints directly under ``output_dir``, oldest first (by step, then name number,
    then time). With ``warn``, each incomplete one (a save that did not finish) is named in a warning.
    A ``<name>.old`` that stands in for ``<name>`` (a crash while replacing it) counts as that one."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        if is_complete(child):
            found.append(child)
        elif child.name.endswith(OLD_SUFFIX) and stand_in(child.with_name(child.name.removesuffix(OLD_SUFFIX))):
            found.append(child)
        elif warn and _looks_unfinished(child):
            warnings.warn(f"skipping incomplete checkpoint {child} (its save did not finish)", stacklevel=3)
    return sorted(found, key=_order)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``output_dir`` (None if there is none); incomplete ones
    (a save that crashed) are skipped with a warning."""
    found = complete_checkpoints(output_dir, warn=True)
    return found[-1] if found else None


def series(name: str) -> str | None:
    """The series a numbered checkpoint folder belongs to: ``"checkpoint-"`` for ``checkpoint-500``
    (and for ``checkpoint-500.old``); None for a name without a number at its end."""
    match = re.fullmatch(r"(.*\D)\d+", name.removesuffix(OLD_SUFFIX))
    return match.group(1) if match else None


def rotate(output_dir: Path, keep: int, newest: Path) -> list[Path]:
    """Delete the oldest complete checkpoints of ``newest``'s series under ``output_dir`` so that
    ``keep`` remain; ``newest`` (the one just saved) is never deleted. Only numbered folders named
    like ``newest`` (``checkpoint-<n>`` beside ``checkpoint-500``) holding a manifest count: a
    hand-kept ``best_model``, a symbolic link or any other folder is never touched. A folder that
    vanishes meanwhile is named in a warning. Returns what was deleted."""
    if keep < 1:
        raise ValueError(f"save_total_limit={keep}: keep at least 1 checkpoint (or None for no rotation)")
    prefix = series(newest.name)
    if prefix is None:
        raise ValueError(f"save_total_limit needs numbered checkpoint folders: {newest.name!r} has no number at "
                         "its end (e.g. checkpoint-500)")
    found = [p for p in complete_checkpoints(output_dir) if series(p.name) == prefix and not p.is_symlink()
             and p.resolve() != newest.resolve()]
    doomed = found[: max(0, len(found) + 1 - keep)]
    deleted = []
    for path in doomed:
        if _remove_vanishing(path, output_dir):
            deleted.append(path)
    number = re.compile(re.escape(prefix) + r"\d+(" + re.escape(OLD_SUFFIX) + ")?" + re.escape(DELETED_SUFFIX))
    for leftover in output_dir.iterdir():  # a deletion that a crash interrupted
        if leftover.is_dir() and not leftover.is_symlink() and number.fullmatch(leftover.name):
            _remove_vanishing(leftover, output_dir)
    return deleted


def _remove_vanishing(path: Path, output_dir: Path) -> bool:
    """``remove_folder``, where a folder that vanished under it (removed by hand, or by another job
    saving into the same folder) is named in a warning instead of failing the save that rotates."""
    try:
        remove_folder(path)
    except FileNotFoundError as exc:
        warnings.warn(f"{path} vanished while save_total_limit deleted it ({exc.strerror}: {exc.filename}): "
                      f"something else deletes checkpoints in {output_dir} (another job saving there, or by hand); "
                      "give each job its own output folder", stacklevel=4)
        return False
    return True


def remove_folder(path: Path) -> None:
    """Delete a checkpoint folder: renamed out of the way first (one atomic step), then removed.

    Only the files that are xshard's (its manifest's, a pending commit's) go; a folder that also holds
    other files (the user's notes, a log) keeps them, without a manifest, under its own name. A
    symbolic link is the user's: it is refused (rotation never counts one), never followed.
    """
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link: xshard never deletes through one, nor the link itself")
    doomed = path if path.name.endswith(DELETED_SUFFIX) else path.with_name(path.name + DELETED_SUFFIX)
    ours = _listed(path) | {PENDING, SAVING_MARKER}
    others = [p for p in path.iterdir() if p.name not in ours and not p.name.startswith("fragment.rank")]
    if others and not path.name.endswith(DELETED_SUFFIX):
        (path / MANIFEST).unlink(missing_ok=True)  # no longer a checkpoint, in one step
        for name in sorted(ours):
            if (path / name).is_file():
                (path / name).unlink()
        warnings.warn(f"{path}: deleted its checkpoint files (save_total_limit) and kept the folder, which holds "
                      f"files xshard did not write: {', '.join(sorted(p.name for p in others))}", stacklevel=3)
        return
    if doomed != path:
        if doomed.exists():
            shutil.rmtree(doomed)
        path.rename(doomed)
    shutil.rmtree(doomed)
