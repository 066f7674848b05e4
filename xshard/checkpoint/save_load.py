"""Save and resume a training job: ``Accelerator.save_state`` / ``load_state``.

A checkpoint folder holds:

    xshard_state.json            the manifest, written last: format version, xshard version, world size,
                                 shard group size (hybrid sharding), stage, backend, state_dict_type,
                                 step, the xshard config, row tables of
                                 every tensor, and the size and checksum of every other file
    model*.safetensors           model weights (formats.py: one plain state dict for "full", rows
                                 per rank for "sharded" and "local")
    optimizer*                   optimizer state (by rows for "full" and "sharded": any world size and
                                 stage resume them; as torch saves it per rank for "local")
    scheduler.pt data.pt         LR schedulers, data loaders' positions (epoch, batches consumed)
    scaler.pt                    fp16 grad scaler (when there is one)
    rng.rank{R}.pt               python, numpy, torch and device RNG states of rank R, and the state each
                                 data loader drew its epoch's base seed from on rank R
    config.json                  the first model's own config, when it has ``config.to_json_string``
                                 (a transformers model): ``xshard consolidate`` then writes a
                                 ``from_pretrained`` folder

Saving is atomic (files.py): a crash or a killed rank leaves the previous checkpoint intact
and a ``.tmp`` folder that ``latest_checkpoint`` skips. Loading reads only safetensors and
``torch.load(weights_only=True)``, checks every file's size and checksum, the model's keys and
shapes and the job's compatibility on every rank *before* anything changes; the ranks agree on the
outcome, so a bad checkpoint raises the same error everywhere and leaves the running job untouched.
All ranks must see the same filesystem (one node, or a shared one). Gradients accumulated inside an
unfinished accumulation window are not saved (a warning says so): save at the end of a window.

Resuming never silently starts over: a folder that does not exist or holds no checkpoint is an
error naming it, unless the caller opts in with ``missing_ok=True`` (a script's first run, before
any checkpoint exists). A folder written by Accelerate for an FSDP model loads too (foreign.py).

What each format writes and reads is the format's own (``format_registry.py`` maps a ``state_dict_type``
or a foreign folder to its object); this module keeps what every format shares: the agreement of the
ranks, the manifest, the commit and the rotation, and putting a checked ``LoadPlan`` into the job.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._version import __version__
from ..errors import because_of
from ..runtime.rank_logging import get_logger
from . import async_save as background
from . import format_registry, formats, output_lock
from .files import (
    FORMAT_VERSION,
    MANIFEST,
    TMP_SUFFIX,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    FileWriter,
    begin,
    check_destination,
    commit,
    complete_checkpoints,
    latest_checkpoint,
    near_name,
    rotate,
    series,
    stand_in,
    write_manifest,
)
from .job_files import RngStates, job_facts
from .load_plan import LoadPlan
from .progress import slow_progress
from .writer import SizeWriter

if TYPE_CHECKING:
    from ..runtime.job import JobState

__all__ = ["CheckpointError", "CheckpointMismatchError", "latest_checkpoint", "load_state", "resume", "save_state"]

log = get_logger("xshard.checkpoint")


def save_state(job: JobState, directory: str | os.PathLike, state_dict_type: str | None = None,
               save_total_limit: int | None = None, async_save: bool = False) -> Path:
    """Write the job's state to ``directory`` (every rank calls this); returns the final path.

    ``state_dict_type``: "full", "local", "sharded" or another registered format's name
    (``format_registry.py``; default: the config's). ``save_total_limit``:
    afterwards keep only that many complete checkpoints of ``directory``'s numbered series
    (``checkpoint-<n>``) in its parent folder, deleting the oldest (never the one just written).
    Files in ``directory`` that xshard did not write are kept; one that a checkpoint file would
    overwrite is refused before anything is written. A full disk is one ``CheckpointSaveError`` on
    every rank naming the folder, the bytes needed and free; nothing of the save is left behind.
    ``async_save``: return once this rank's state is copied to host memory and write it in the
    background (``async_save.py``); a save still being written is waited for first.
    """
    wait_for_background_save(job)
    kind = state_dict_type or job.config.state_dict_type
    fmt = format_registry.writing_format(kind)  # a ValueError naming the accepted types
    final = Path(directory)
    if save_total_limit is not None:
        _check_rotation(final, save_total_limit)
    if job.micro_step != 0:
        warnings.warn(
            f"save_state({str(final)!r}) inside an accumulation window ({job.micro_step} of "
            f"{job.gradient_accumulation_steps} micro-steps done): the gradients accumulated so far are not "
            "saved, so a resumed run steps with fewer samples in this window. Save after optimizer.step() "
            "at the end of a window (when accelerator.sync_gradients is True) to resume exactly.",
            stacklevel=3,
        )
    _check_destination_everywhere(job, final)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    writer = FileWriter(tmp, job.rank)
    error: BaseException | None = None
    try:
        begin(final, job.is_main_process)
    except OSError as exc:
        error = exc
    _agree_on_save(job, final, tmp, error, writer)
    job.backend.mark_step()  # compiled devices: materialise pending updates before reading tensors
    head = _manifest_head(job, kind)  # the job as it is now (the background commit runs later)
    if async_save:
        background_commit = ((lambda: _commit(tmp, final, head, job.world_size, save_total_limit))
                             if job.is_main_process else None)
        background.AsyncSaver.of(job).start(tmp, final, lambda staged: fmt.write(job, staged),
                                            background_commit, job.backend.synchronize)
        return final

    tables: dict[str, Any] = {}
    try:
        with slow_progress(f"saving {final.name}") as bar:
            writer.on_bytes = bar.update
            tables = fmt.write(job, writer)
        # Each rank's file list and row tables travel to rank 0 through the shared folder.
        if writer.no_space is None:
            (tmp / f"fragment.rank{job.rank}.json").write_text(
                json.dumps({"files": writer.files, "tables": tables}, default=str))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            writer.no_space = exc
        else:
            error = exc
    _agree_on_save(job, final, tmp, error, writer)

    if job.is_main_process:
        try:
            write_manifest(tmp, _manifest(head, tmp, job.world_size))
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            writer.no_space = exc
    _agree_on_save(job, final, tmp, None, writer)
    if job.is_main_process:
        _commit_and_rotate(tmp, final, kind, save_total_limit)
    job.barrier()
    return final


def cannot_write(final: Path, exc: OSError) -> CheckpointSaveError:
    """One line for an error of the operating system while a save starts: the folder and the fix."""
    where = Path(exc.filename).parent if exc.filename else final.parent
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"save to a folder this process may write to, or make {where} writable"
    else:
        fix = "check the folder, or save somewhere else"
    error = CheckpointSaveError(f"cannot save the checkpoint {final}: {where}: {exc.strerror or exc}; {fix}; nothing "
                                "was written")
    error.__cause__ = exc
    return error


def _check_destination_everywhere(job: JobState, final: Path) -> None:
    """Every rank checks the destination (``check_destination``), then all learn whether any refused it.

    The main process first takes the output folder for the job (a numbered checkpoint's parent:
    ``output_lock.py``); another running job's lock there is the same refusal on every rank.
    The agreement comes before rank 0 creates the save's ``.tmp`` folder: a rank still checking while
    rank 0 creates it could otherwise see it half made (a folder, then its marker) and refuse alone.
    """
    refusal: CheckpointSaveError | None = None
    try:
        if job.is_main_process and series(final.name) is not None:
            output_lock.take(final.parent)  # the output folder is this job's (output_lock.py)
        check_destination(final)
    except CheckpointSaveError as exc:
        refusal = exc
    except OSError as exc:  # a read-only folder, no permission
        refusal = cannot_write(final, exc)
    (in_use, refused) = _ranks_where(job, isinstance(refusal, output_lock.OutputFolderInUseError),
                                     refusal is not None)
    if refusal is not None:
        raise refusal
    if in_use:  # the main process's one line, read from the same lock file
        raise output_lock.OutputFolderInUseError(output_lock.refusal(final.parent))
    if refused:
        raise CheckpointSaveError(f"cannot save a checkpoint to {final}: {refused} other rank(s) refused the folder "
                                  "(their error is in their log; every rank must see the same folder); nothing was "
                                  "written")


def _check_rotation(final: Path, save_total_limit: int) -> None:
    """Refuse, before writing, a ``save_total_limit`` that rotation cannot honour."""
    if isinstance(save_total_limit, bool) or not isinstance(save_total_limit, int) or save_total_limit < 1:
        raise ValueError(f"save_total_limit={save_total_limit!r}: keep at least 1 checkpoint (or None for no "
                         "rotation)")
    if series(final.name) is None:
        raise ValueError(f"save_total_limit={save_total_limit} rotates numbered checkpoint folders, and "
                         f"{final.name!r} has no number at its end: save to e.g. {final.parent / 'checkpoint-500'}, "
                         "or drop save_total_limit")


def _manifest_head(job: JobState, kind: str) -> dict[str, Any]:
    """The manifest's description of the job at the moment of the save (every key but the files)."""
    return {
        "format_version": FORMAT_VERSION,
        "xshard_version": __version__,
        "state_dict_type": kind,
        **job_facts(job),
        "step": job.step,
        "micro_step": job.micro_step,
        "config": job.config.to_dict(),
    }


def _manifest(head: dict[str, Any], tmp: Path, world_size: int) -> dict[str, Any]:
    """Rank 0: the manifest, ``head`` with every rank's fragment (files and row tables)."""
    files: dict[str, Any] = {}
    parts: dict[str, list[dict[str, Any]]] = {}
    for rank in range(world_size):
        path = tmp / f"fragment.rank{rank}.json"
        part = json.loads(path.read_text())
        path.unlink()
        files.update(part["files"])
        for name, table in part["tables"].items():
            parts.setdefault(name, []).append(table)
    return {
        **head,
        "tables": {name: formats.merge_tables(p) for name, p in parts.items()},
        "files": files,
    }


def _commit_and_rotate(tmp: Path, final: Path, kind: str, save_total_limit: int | None) -> None:
    """Rank 0, once the manifest is in ``tmp``: the commit, then the rotation."""
    commit(tmp, final)
    log.info("saved %s checkpoint to %s", kind, final)
    if save_total_limit is not None:
        for path in rotate(final.parent, save_total_limit, final):
            log.info("deleted old checkpoint %s (save_total_limit=%d)", path, save_total_limit)


def _commit(tmp: Path, final: Path, head: dict[str, Any], world_size: int, save_total_limit: int | None) -> None:
    """Rank 0's background thread, once every rank's files and fragment are in ``tmp``: the manifest,
    the commit, the rotation (an error is kept by the saver and raised at the next call)."""
    write_manifest(tmp, _manifest(head, tmp, world_size))
    _commit_and_rotate(tmp, final, head["state_dict_type"], save_total_limit)


def wait_for_background_save(job: JobState) -> None:
    """Wait for an async save of this job still being written; raise its error on every rank if it failed."""
    background.wait(job, lambda failed: _which_ranks(job, failed))


def _agree_on_save(job: JobState, final: Path, tmp: Path, error: BaseException | None, writer: FileWriter) -> None:
    """Every rank learns whether any rank failed its part of the save (this replaces a barrier): then
    rank 0 removes the ``.tmp`` folder and every rank raises, a full disk as one line with the bytes
    the checkpoint needs (all ranks' files) and the bytes free."""
    failed, full, needed, bits = _sum_over_ranks(job, [error is not None, writer.no_space is not None,
                                                        writer.bytes_needed, _rank_bit(job.rank, error is not None)])
    if not failed and not full:
        return
    if job.is_main_process and tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    where = final.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    # rank 0's reading of the free space, on every rank: the same line everywhere
    (free,) = _sum_over_ranks(job, [shutil.disk_usage(where).free if job.is_main_process else 0])
    if full:
        raise CheckpointSaveError(
            f"cannot save the checkpoint {final}: the disk is full (it needs {needed:,} bytes, {free:,} are free "
            f"in {where}); free some space or save to another disk. Nothing of this save was kept; earlier "
            "checkpoints are intact") from writer.no_space
    if isinstance(error, OSError) and not isinstance(error, CheckpointSaveError):
        raise cannot_write(final, error) from error
    if error is not None:
        raise error
    raise background.OtherRankSaveError(f"cannot save the checkpoint {final} {because_of(_ranks_of(bits), failed)} "
                                        "to write its part (that rank's own error says why); nothing of this save "
                                        "was kept")


def planned_files(job: JobState, state_dict_type: str | None = None) -> dict[str, int]:
    """The files this rank would write in ``save_state`` (name -> bytes), written nowhere (a dry run asks).

    The same code as a save, through a writer that only counts (``writer.SizeWriter``): the format asks it
    ``counts_only`` where counting may skip work (a ``full`` checkpoint's model file, which a save gathers on
    rank 0, is counted from the model's shapes, its ties once).
    """
    writer = SizeWriter(job.rank)
    format_registry.writing_format(state_dict_type or job.config.state_dict_type).write(job, writer)
    return writer.files


def _read_everything(job: JobState, root: Path, on_bytes: Callable[[int], None] | None = None) -> LoadPlan:
    """Read and check all this rank needs from the checkpoint (its format's ``read``); change nothing."""
    return format_registry.reading_format(root).read(job, root, on_bytes)


#: ranks below this are named by a failed save's agreement: one bit each of an int64 value
_NAMED_RANKS = 63


def _rank_bit(rank: int, flag: bool) -> int:
    """This rank's bit when ``flag`` is set: summed over the ranks, the bits say which ranks set it."""
    return 1 << rank if flag and rank < _NAMED_RANKS else 0


def _ranks_of(bits: int) -> list[int]:
    """The ranks whose ``_rank_bit`` is in ``bits``."""
    return [rank for rank in range(_NAMED_RANKS) if bits >> rank & 1]


def _which_ranks(job: JobState, flag: bool) -> tuple[int, list[int]]:
    """How many ranks have ``flag`` set, and which of them (those below ``_NAMED_RANKS``): one agreement."""
    count, bits = _sum_over_ranks(job, [1 if flag else 0, _rank_bit(job.rank, flag)])
    return count, _ranks_of(bits)


def _ranks_where(job: JobState, *flags: bool) -> list[int]:
    """For each flag, how many ranks have it set (every rank gets the same answer)."""
    return _sum_over_ranks(job, [1 if f else 0 for f in flags])


#: every agreement of a save or a load sends this many values (padded with zeros): one all-reduce of
#: one shape, which a compiling device (XLA) compiles once instead of once per count of values
_AGREEMENT_WIDTH = 4


def _sum_over_ranks(job: JobState, values: list[int]) -> list[int]:
    """Each value summed over the ranks, exactly (int64: byte counts), the same answer on every rank."""
    if job.world_size == 1:
        return [int(v) for v in values]
    if len(values) > _AGREEMENT_WIDTH:
        raise ValueError(f"an agreement carries at most {_AGREEMENT_WIDTH} values, got {len(values)}")
    padded = [int(v) for v in values] + [0] * (_AGREEMENT_WIDTH - len(values))
    total = torch.tensor(padded, dtype=torch.int64, device=job.backend.device())
    job.backend.collectives.all_reduce(total, op="sum")
    return [int(v) for v in total.tolist()[:len(values)]]


def _agree(job: JobState, error: BaseException | None, root: Path) -> None:
    """Every rank learns whether any rank failed to read the checkpoint, so all raise or none does,
    and all raise the same kind of error (a mismatch with the job, or a bad or missing file)."""
    failed, mismatched = _ranks_where(job, error is not None, isinstance(error, CheckpointMismatchError))
    if error is not None:
        raise error
    if failed:
        kind = CheckpointMismatchError if mismatched else CheckpointError
        raise kind(f"{root}: {failed} other rank(s) could not read this checkpoint (their error is in their log); "
                   "nothing was loaded")


def _present_everywhere(job: JobState, present: bool, root: Path) -> bool:
    """Whether the checkpoint exists for every rank; an error when only some ranks see it."""
    (seen,) = _ranks_where(job, present)
    if 0 < seen < job.world_size:
        raise CheckpointError(f"{root}: only {seen} of {job.world_size} ranks see a checkpoint here; every rank "
                              "must see the same folder (a shared filesystem, or a copy on every node)")
    return seen > 0


def load_state(job: JobState, directory: str | os.PathLike, *, missing_ok: bool = False) -> Path | None:
    """Restore what ``save_state`` wrote into the objects this Accelerator prepared; returns the path.

    Everything is read and checked first; the model, optimizer and the rest change only when every
    rank read the whole checkpoint successfully. A folder that does not exist is an error naming it;
    with ``missing_ok=True`` nothing is loaded and None is returned instead.
    """
    wait_for_background_save(job)
    root = Path(directory)
    old = stand_in(root)
    if old is not None and format_registry.foreign_format(root) is None:  # a crash while commit() replaced it
        root = old
    if missing_ok and not _present_everywhere(job, root.exists(), root):
        log.info("no checkpoint at %s (missing_ok=True): starting from scratch", root)
        return None
    error: BaseException | None = None
    plan: LoadPlan | None = None
    try:
        with slow_progress(f"loading {root.name}") as bar:
            plan = _read_everything(job, root, bar.update)
    except Exception as exc:  # every failure must reach _agree, or the other ranks would wait forever
        log.error("rank %d cannot load %s: %s", job.rank, root, exc)
        error = exc if isinstance(exc, CheckpointError) else CheckpointError(f"{root}: {exc}")
        if error is not exc:
            error.__cause__ = exc
    _agree(job, error, root)
    assert plan is not None  # every rank read its plan: _agree raised otherwise
    _apply(job, plan, root)
    job.barrier()
    log.info("resumed from %s (step %d)", root, job.step)
    return root


def _apply(job: JobState, plan: LoadPlan, root: Path) -> None:
    """Put a checked plan into the job's objects (parts a foreign checkpoint lacks are None: kept).

    All or nothing: the small objects (schedulers, data loaders, scaler, registered objects) go first,
    each one's state kept beforehand; if any rank cannot take its part (a state dict its object
    refuses), every rank puts those back and raises, before any model or optimizer changed.
    """
    from ..sharding.state_dict import load_local_pieces

    small: list[tuple[Any, Any]] = [
        *zip(job.schedulers, plan.schedulers or [None] * len(job.schedulers), strict=True),
        *zip(job.loaders, plan.data or [None] * len(job.loaders), strict=True),
        *zip(job.custom_objects, plan.custom, strict=False)]
    if job.scaler is not None and plan.scaler is not None:
        small.append((job.scaler, plan.scaler))
    small.append((RngStates(job), plan.rng))
    small = [(obj, state) for obj, state in small if state is not None]
    kept = [copy.deepcopy(obj.state_dict()) for obj, _ in small]
    error: BaseException | None = None
    done = 0
    try:
        for obj, state in small:
            obj.load_state_dict(state)
            done += 1
    except Exception as exc:
        error = CheckpointError(f"{root}: the checkpoint's state of {type(small[done][0]).__name__} cannot be "
                                f"loaded into it ({exc}); nothing was loaded")
        error.__cause__ = exc
        log.error("rank %d cannot load %s: %s", job.rank, root, error)
    try:
        _agree(job, error, root)
    except CheckpointError:
        for (obj, _), state in zip(small[:done], kept, strict=False):
            obj.load_state_dict(state)
        raise
    for model, rows in zip(job.models, plan.models, strict=True):
        if rows is not None:  # None: a model the checkpoint does not hold (trainer_folder.py) keeps its weights
            load_local_pieces(model, rows)
    for opt, state in zip(job.optimizers, plan.optimizers, strict=True):
        if state is not None:
            opt.load_state_dict(state)
    job.micro_step = int(plan.micro_step)
    job.step = int(plan.step)


def resume(job: JobState, output_dir: str | os.PathLike, *, missing_ok: bool = False) -> Path | None:
    """Load the newest complete checkpoint under ``output_dir`` (or ``output_dir`` itself, when it is one).

    No complete checkpoint there is an error naming the folder; with ``missing_ok=True`` (a script's
    first run) it is logged, nothing is loaded and None is returned. When the newest checkpoint's
    files are damaged (truncated, corrupted, missing), a warning names the file and the next older
    complete checkpoint is loaded instead; a checkpoint of another model or job is an error.
    """
    wait_for_background_save(job)
    root = Path(output_dir)
    if (root / MANIFEST).is_file() or format_registry.foreign_format(root) is not None or stand_in(root) is not None:
        candidates = [root]
    else:
        latest = latest_checkpoint(root)  # warns about incomplete ones
        candidates = complete_checkpoints(root)[::-1] if latest is not None else []
    if not _present_everywhere(job, bool(candidates), root):
        if missing_ok:
            log.info("no complete checkpoint under %s (missing_ok=True): starting from scratch", root)
            return None
        raise CheckpointError(_nothing_to_resume(root))
    for i, path in enumerate(candidates):
        try:
            return load_state(job, path)
        except CheckpointMismatchError:
            raise
        except CheckpointError as exc:
            if len(candidates) == 1:
                raise
            if i + 1 == len(candidates):
                raise CheckpointError(f"{root}: none of its {len(candidates)} complete checkpoint(s) can be loaded; "
                                      f"the oldest failed with: {exc}") from exc
            log.warning("cannot load %s (%s): falling back to the previous checkpoint %s", path, exc,
                        candidates[i + 1])
    raise AssertionError("unreachable")  # pragma: no cover


def _nothing_to_resume(root: Path) -> str:
    fix = ("fix the path, or pass missing_ok=True to start from scratch when no checkpoint exists yet "
           "(a first run)")
    if not root.is_dir():
        return f"{root}: no such folder{near_name(root)}, so there is no checkpoint to resume from; {fix}"
    incomplete = [p.name for p in sorted(root.iterdir()) if p.is_dir() and p.name.endswith(TMP_SUFFIX)]
    detail = f" (incomplete, skipped: {', '.join(incomplete)})" if incomplete else ""
    return f"{root} holds no complete checkpoint{detail}, so there is nothing to resume from; {fix}"
