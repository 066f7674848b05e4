"""Checkpoint files written around the page cache (``O_DIRECT``) where the filesystem allows it.

Why. A buffered write first copies every byte into the page cache, and the kernel finds a fresh
page for each: on the 2-core VM of benchmarks/RESULTS.md that cost about 2 s of CPU per GB written
to a new file (0.3 s once the pages had been used), in the writing thread, as system time. A save is
mostly that: a blocking ``save_state`` of 1.8 GB per rank spent 3.4-4.3 s of its 4.8-5.4 s on the
CPU, and an async save's background thread 3.0-3.7 s, taken from the training steps beside it on a
machine whose cores training keeps busy. ``O_DIRECT`` hands the device the writer's own buffer
instead: about 0.03 s of CPU per GB here.

How. ``BlockWriter`` collects what is written into one page-aligned buffer (8 MiB, one per thread,
kept) and writes it whole, so that every direct write has the address, length and file offset
``O_DIRECT`` requires. Data that is itself page-aligned and met at a chunk boundary of the file (an
async save's staged file images, ``async_save.HostStaging.image``) is written whole chunks at a time
from where it is, without that copy. The file's tail (less than a buffer) is written after
``O_DIRECT`` is turned off on the descriptor (``fcntl``), so a file is never padded. Where ``O_DIRECT`` is not there (macOS,
Windows) or refused (tmpfs refuses it at ``open``; a filesystem may refuse it at the first write,
``EINVAL``), the same writer writes through the page cache as before: one code path, the same bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Any

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no fcntl, and no O_DIRECT either
    fcntl = None  # type: ignore[assignment]

#: ``O_DIRECT`` where the platform has it (Linux), else 0: then every file is written buffered
O_DIRECT: int = getattr(os, "O_DIRECT", 0) if fcntl is not None else 0
#: bytes per write: a multiple of every block size O_DIRECT may require (512 B to 64 KiB)
CHUNK = 8 * 2**20

_local = threading.local()


def opener(path: str, flags: int) -> int:
    """``open(..., opener=opener)``: the file opened with ``O_DIRECT`` when the filesystem takes it."""
    if O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                raise
    return os.open(path, flags, 0o666)


def _buffer() -> mmap.mmap:
    """This thread's page-aligned write buffer (an anonymous mapping: aligned to a page by the kernel)."""
    buf = getattr(_local, "buffer", None)
    if buf is None:
        buf = _local.buffer = mmap.mmap(-1, CHUNK)
    return buf


def _address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class BlockWriter:
    """A binary file object over ``raw`` (an unbuffered file) that writes whole ``CHUNK``s, directly when
    the descriptor has ``O_DIRECT``. Call ``finish()`` once after the last ``write``."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self._fd = raw.fileno()
        self._direct = bool(O_DIRECT) and bool(fcntl.fcntl(self._fd, fcntl.F_GETFL) & O_DIRECT)
        self._buf = memoryview(_buffer())
        self._used = 0

    @property
    def direct(self) -> bool:
        """Are whole chunks written around the page cache?"""
        return self._direct

    def write(self, data: Any) -> int:
        """Take ``data`` (any bytes-like object); the file grows by a chunk each time the buffer fills."""
        view = memoryview(data).cast("B")
        done = 0
        if self._direct and not self._used and len(view) >= CHUNK and _address(view) % mmap.PAGESIZE == 0:
            whole = len(view) // CHUNK * CHUNK  # the file stays at a chunk boundary: no copy needed
            self._write_all(view[:whole])
            done = whole
        while done < len(view):
            take = min(CHUNK - self._used, len(view) - done)
            self._buf[self._used:self._used + take] = view[done:done + take]
            self._used += take
            done += take
            if self._used == CHUNK:
                self._write_all(self._buf)
                self._used = 0
        return len(view)

    def flush(self) -> None:
        """Nothing to do: bytes reach the file as whole chunks, and the tail at ``finish()``."""

    def finish(self) -> None:
        """Write what is left (less than a chunk) through the page cache; the file has its exact length."""
        if self._used:
            self._buffered()
            self._write_all(self._buf[:self._used])
            self._used = 0

    def _buffered(self) -> None:
        if self._direct:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~O_DIRECT)
            self._direct = False

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                written = self.raw.write(view[done:])
            except OSError as exc:
                # a filesystem that took O_DIRECT at open may refuse it at a write (as may a short write's
                # unaligned rest): go on from the same byte through the page cache
                if not (self._direct and exc.errno == errno.EINVAL):
                    raise
                self._buffered()
                continue
            done += written if written is not None else len(view) - done
