"""Async save: copy this rank's checkpoint state to host memory, return, write the files in the background.

``save_state(..., async_save=True)`` runs the part of a save that needs the other ranks or the live
tensors in the foreground: the model's gather (a collective) and a copy of everything this rank
writes into host buffers (``HostStaging``). Training then goes on while a background thread writes
the same files a blocking save writes (``StagingWriter`` records the files and replays them through
the same ``FileWriter``), and rank 0's thread commits the checkpoint exactly as a blocking save does:
the manifest last, then the rename into place (``files.commit``). A crash during the background
write therefore leaves a ``.tmp`` folder and the previous checkpoint loadable.

Without a collective in the background (one thread of a process group may not interleave its
collectives with the training loop's), the ranks meet through the checkpoint folder: each rank's
thread renames its ``fragment.rank<R>.json`` into place when its files are on disk, and rank 0's
thread commits once every fragment is there. The next ``save_state``, ``load_state`` and
``Accelerator.end()`` wait for the write (``AsyncSaver.finish``); an error of any rank's write is
raised there, on every rank, never lost.

Host memory: one copy of what this rank writes (its rows of the optimizer state and, for "full"
checkpoints on rank 0, the whole model; ``state_dict_type="sharded"`` spreads the model over the
ranks too). The buffers are kept and reused by the next save of the same sizes; on backends that
pin host memory (``Backend.pins_host_memory``) they are page-locked once, and the copies from the
device run asynchronously.

CPU: the background thread hashes (xxh3-128, ``checksum.py``) and hands each staged file image's whole
chunks to the device as they lie in memory, around the page cache (``direct_io.py``): 0.13-0.22 s of one
core for 1.81 GB on the benchmark's VM, against 3.0-3.7 s when it wrote through the page cache and
0.34-0.48 s when it copied each chunk once more (``write_cpu_seconds`` records it per save). It
runs at the training's CPU priority, on purpose: at the lowest (nice 19, per thread on Linux) training
slowed less on a machine with a core to spare, but 2.8x per step instead of 1.5x on one whose cores
other processes kept busy (dataloader workers can): the GIL. Each time the writer comes back from a
call that released the GIL it asks for it, and the training thread, made to hand it over, waits until
the writer runs, which a starved low-priority thread does late. A writer in a process of its own would
not share the GIL; not done.
"""

from __future__ import annotations

import atexit
import copy
import json
import mmap
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..backends.call_thread import Call, CallThread
from ..errors import OtherRankFailedError, because_of
from ..runtime.rank_logging import get_logger
from .files import CheckpointError, CheckpointSaveError, FileWriter
from .tensorfile import PT_METADATA, safetensors_header, tensor_bytes

if TYPE_CHECKING:
    from ..runtime.job import JobState

log = get_logger("xshard.checkpoint")

#: how often rank 0's thread looks for the other ranks' fragments
_POLL_SECONDS = 0.05
#: how long rank 0's thread waits for them when the job has no timeout of its own
_DEFAULT_WAIT_SECONDS = 1800.0


class _OtherRanksFailed(CheckpointError):
    """Rank 0 could not commit because another rank's background write failed (that rank reports why)."""


class OtherRankSaveError(OtherRankFailedError, CheckpointSaveError, CheckpointError):
    """This rank's part of a save (blocking or in the background) was written, another rank's was not: the
    message names that rank, whose own error says why; nothing of the save was kept."""


class HostStaging:
    """Host copies of what a save writes, reused across saves of the same sizes.

    - ``image``: a safetensors file's exact bytes (header, then each tensor's bytes) in one page-aligned
      buffer, which the background thread hands to the device as it is (``direct_io``: no second copy).
    - ``copy``: objects for ``torch.save``, one buffer per distinct storage. Tensors that share a storage
      (views) stay views of one copied storage, with their offsets and strides, so ``torch.save`` of the
      copies writes the same bytes as of the originals.
    """

    def __init__(self, buffer: Callable[[int], torch.Tensor]) -> None:
        self._new_buffer = buffer
        #: (bytes, page-aligned?) -> flat uint8 host buffers free for this save
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._used: list[tuple[tuple[int, bool], torch.Tensor]] = []
        self._copied: dict[tuple[int, int, str], torch.UntypedStorage] = {}
        self.bytes_allocated = 0

    def begin(self) -> None:
        """Start a save: the buffers of the previous one (already written) become free again."""
        for key, buffer in self._used:
            self._free.setdefault(key, []).append(buffer)
        self._used, self._copied = [], {}

    def image(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> torch.Tensor:
        """The bytes of the safetensors file of ``tensors`` (any device), as one flat page-aligned uint8
        host tensor: what ``write_safetensors`` would write, copied once."""
        head = safetensors_header(tensors, metadata)
        pieces = [tensor_bytes(t) for t in tensors.values()]  # on each tensor's own device
        image = self._buffer(len(head) + sum(p.numel() for p in pieces), aligned=True)
        image[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        at = len(head)
        for piece in pieces:
            image[at:at + piece.numel()].copy_(piece, non_blocking=image.is_pinned())
            at += piece.numel()
        return image

    def _buffer(self, nbytes: int, aligned: bool) -> torch.Tensor:
        """A flat uint8 host buffer of exactly ``nbytes`` (its storage too, unless ``aligned``: then it
        starts at a page), from the pool or new."""
        key = (nbytes, aligned)
        free = self._free.get(key)
        if free:
            buffer = free.pop()
        elif aligned:
            # a page more than asked, to start at a page: pinned buffers are page-aligned already, a
            # pageable one is aligned only as far as torch's allocator aligns it (64 bytes)
            whole = self._new_buffer(nbytes + mmap.PAGESIZE)
            skip = -whole.data_ptr() % mmap.PAGESIZE
            buffer = whole[skip:skip + nbytes]
            self.bytes_allocated += whole.numel()
        else:
            buffer = self._new_buffer(nbytes)
            self.bytes_allocated += nbytes
        self._used.append((key, buffer))
        return buffer

    def copy(self, obj: Any) -> Any:
        """``obj`` (tensors in dicts, lists and tuples) with every tensor copied to host memory and every
        other leaf deep-copied, so that training may change the originals while the copy is written.
        An object met twice is copied once (pickle then writes the same references as for ``obj``)."""
        return self._copy(obj, {})

    def _copy(self, obj: Any, memo: dict[int, Any]) -> Any:
        done = memo.get(id(obj))
        if done is not None:
            return done
        if isinstance(obj, torch.Tensor):
            made: Any = self._tensor(obj)
        elif isinstance(obj, dict):
            items = [(k, self._copy(v, memo)) for k, v in obj.items()]
            try:
                made = type(obj)(items)
            except TypeError:  # a dict subclass with another constructor
                made = dict(items)
        elif type(obj) in (list, tuple):
            made = type(obj)(self._copy(v, memo) for v in obj)
        else:
            made = copy.deepcopy(obj, memo)
        memo[id(obj)] = made
        return made

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        source = tensor.untyped_storage()
        # Live storages have distinct addresses; empty ones all sit at 0 and are never shared.
        key = (source.data_ptr(), source.nbytes(), str(source.device))
        host = self._copied.get(key) if source.nbytes() else None
        if host is None:
            host = self._storage(source.nbytes())
            if source.nbytes():
                # torch's stubs demand a stride beside the size; the default (contiguous) is what is meant
                whole = torch.empty(0, dtype=torch.uint8, device=source.device).set_(  # type: ignore[call-overload]
                    source, 0, (source.nbytes(),))
                target = torch.empty(0, dtype=torch.uint8).set_(host, 0, (source.nbytes(),))  # type: ignore[call-overload]
                target.copy_(whole, non_blocking=host.is_pinned())
            self._copied[key] = host
        return torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _storage(self, nbytes: int) -> torch.UntypedStorage:
        # the buffer's whole storage (torch.save writes whole storages): exactly ``nbytes``, not aligned
        return self._buffer(nbytes, aligned=False).untyped_storage()


class StagingWriter:
    """A ``writer.Writer`` that records each file with its data copied to host memory, for ``replay``."""

    counts_only = False

    def __init__(self, rank: int, staging: HostStaging) -> None:
        self.rank = rank
        self._staging = staging
        self._files: list[tuple[str, str, tuple[Any, ...]]] = []

    @property
    def files(self) -> dict[str, str]:
        """The files recorded so far: name -> how ``replay`` writes it ("image", "torch" or "text")."""
        return {name: kind for kind, name, _ in self._files}

    def safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] = PT_METADATA) -> None:
        """Record a safetensors file, as the image of its bytes (``HostStaging.image``)."""
        self._files.append(("image", name, (self._staging.image(tensors, metadata),)))

    def torch(self, name: str, obj: Any) -> None:
        """Record a ``torch.save`` file."""
        self._files.append(("torch", name, (self._staging.copy(obj),)))

    def text(self, name: str, text: str) -> None:
        """Record a text file."""
        self._files.append(("text", name, (text,)))

    def replay(self, writer: FileWriter) -> None:
        """Write every recorded file, in order, through ``writer``."""
        for kind, name, args in self._files:
            getattr(writer, kind)(name, *args)


class AsyncSaver:
    """The background writes of one job: at most one at a time, and the host buffers they reuse."""

    def __init__(self, job: JobState) -> None:
        self.staging = HostStaging(job.backend.host_buffer)
        self.rank = job.rank
        self.world_size = job.world_size
        timeout = job.timeout  # the job's (Accelerator(timeout=...), else the config's): the others' writes get as long
        #: how long rank 0's thread waits for the other ranks' files before it gives the checkpoint up
        self.wait_seconds = float(timeout) if timeout else _DEFAULT_WAIT_SECONDS
        #: the one thread that writes (started at the first save: ``backends/call_thread.py`` says why one)
        self._writer: CallThread | None = None
        #: the running background write (None when none is started and not yet waited for)
        self._write_call: Call | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None
        #: the running save's ``.tmp`` folder (removed by rank 0 when the save fails)
        self.tmp: Path | None = None
        #: seconds this rank's last background write took (files, fragment and, on rank 0, the commit)
        self.write_seconds: float | None = None
        #: CPU seconds (user and system) its thread spent on it: what it took from training on a busy core
        self.write_cpu_seconds: float | None = None
        atexit.register(self._report_at_exit)

    @classmethod
    def of(cls, job: JobState) -> AsyncSaver:
        """The job's saver (made at its first async save)."""
        saver = job.async_saver
        if not isinstance(saver, AsyncSaver):
            saver = job.async_saver = cls(job)
        return saver

    def start(self, tmp: Path, final: Path, write_files: Callable[[StagingWriter], dict[str, Any]],
              commit: Callable[[], None] | None, synchronize: Callable[[], None]) -> None:
        """Copy this rank's files to host memory (``write_files`` with a ``StagingWriter``; collectives run
        here, in the caller's thread), then write them and, on rank 0 (``commit``), commit in the background."""
        self.staging.begin()
        writer = StagingWriter(self.rank, self.staging)
        tables = write_files(writer)
        synchronize()  # the copies from the device are complete before training changes the tensors
        self._path, self._error, self.write_seconds, self.write_cpu_seconds = final, None, None, None
        self.tmp = tmp
        if self._writer is None:
            self._writer = CallThread("xshard-async-save")
        self._write_call = self._writer.submit(lambda: self._write(tmp, writer, tables, commit))
        log.info("saving %s in the background (%.2f GB of host buffers)", final, self.staging.bytes_allocated / 1e9)

    def _write(self, tmp: Path, staged: StagingWriter, tables: dict[str, Any], commit: Callable[[], None] | None) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            writer = FileWriter(tmp, self.rank)
            staged.replay(writer)
            if writer.no_space is not None:  # the writer only counted what did not fit: nothing to commit
                raise _disk_full(tmp, writer)
            fragment = tmp / f"fragment.rank{self.rank}.json"
            part = fragment.with_name(fragment.name + ".part")
            part.write_text(json.dumps({"files": writer.files, "tables": tables}, default=str))
            os.replace(part, fragment)  # rank 0 sees a fragment only once it is complete
            if commit is not None:
                self._wait_for_fragments(tmp)
                commit()
            self.write_seconds = time.perf_counter() - started
            self.write_cpu_seconds = time.thread_time() - cpu_started
        except BaseException as exc:  # kept for the next call on the training thread
            self._error = exc
            if self.rank != 0:  # so that rank 0 stops waiting for this rank's fragment
                (tmp / f"fragment.rank{self.rank}.failed").touch()
            if not isinstance(exc, _OtherRanksFailed):
                log.error("rank %d: the background write of %s failed: %s", self.rank, self._path, exc)

    def _wait_for_fragments(self, tmp: Path) -> None:
        deadline = time.monotonic() + self.wait_seconds
        names = [tmp / f"fragment.rank{r}.json" for r in range(self.world_size)]
        while not all(n.is_file() for n in names):
            failed = [r for r in range(self.world_size) if (tmp / f"fragment.rank{r}.failed").exists()]
            if failed:
                raise _OtherRanksFailed(f"{tmp}: rank(s) {failed} failed to write their files")
            if time.monotonic() > deadline:
                missing = [r for r, n in enumerate(names) if not n.is_file()]
                raise CheckpointError(f"{tmp}: rank(s) {missing} did not finish their files within "
                                      f"{self.wait_seconds:.0f} s; the checkpoint was not committed")
            time.sleep(_POLL_SECONDS)

    @property
    def pending(self) -> bool:
        """Is a background write started and not yet waited for?"""
        return self._write_call is not None

    def finish(self) -> tuple[Path | None, BaseException | None]:
        """Wait for the background write; its path and this rank's error (None when it succeeded)."""
        if self._write_call is None:
            return None, None
        self._write_call.done.wait()
        path, error = self._path, self._error
        self._write_call, self._error = None, None
        return path, error

    def _report_at_exit(self) -> None:
        """A write that failed after the script's last call must not pass unnoticed."""
        # the writer is a daemon thread: the interpreter's exit waits for the write here, before it ends it
        if self._write_call is not None:
            self._write_call.done.wait()
            if self._error is not None:
                log.error("the background write of %s failed and nothing waited for it (call accelerator.end() "
                          "at the end of the script): %s", self._path, self._error)


def _disk_full(tmp: Path, writer: FileWriter) -> CheckpointSaveError:
    """A full disk during the background write, with the bytes this rank's files need and the bytes free."""
    written = sum(entry["bytes"] for entry in writer.files.values())  # freed again when the save is removed
    try:
        free = f"{shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free + written:,}"
    except OSError:
        free = "unknown"
    reason = writer.no_space.strerror if writer.no_space is not None else None
    error = CheckpointSaveError(f"the disk is full ({reason or 'no space left'}: this rank's files need "
                                f"{writer.bytes_needed:,} bytes, {free} are free in {tmp.parent}); free some space or "
                                "save to another disk")
    error.__cause__ = writer.no_space
    return error


def wait(job: JobState, ranks_failed: Callable[[bool], tuple[int, list[int]]]) -> None:
    """Wait for the job's background write, if any; raise on every rank if any rank's write failed.

    ``ranks_failed(flag)`` tells how many ranks pass True and which (a collective every rank calls).
    """
    saver = job.async_saver
    if not isinstance(saver, AsyncSaver) or not saver.pending:
        return
    path, error = saver.finish()
    own = error is not None and not isinstance(error, _OtherRanksFailed)
    failed, which = ranks_failed(own)
    if (failed or error is not None) and saver.rank == 0 and saver.tmp is not None:
        shutil.rmtree(saver.tmp, ignore_errors=True)  # every rank's thread has ended: nothing writes there now
    if own:
        raise CheckpointError(f"the background write of {path} failed: {error}; the previous checkpoint is "
                              "intact and nothing of this save was kept") from error
    if failed or error is not None:
        raise OtherRankSaveError(f"{path} was not committed {because_of(which, failed)} to write its part in the "
                                 "background (that rank's own error says why); the previous checkpoint is intact")
    log.info("background save of %s finished", path)
