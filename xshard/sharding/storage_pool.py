"""Freed full-parameter memory kept for the next gather of the same size, where the device's allocator does not.

Used where ``Backend.allocator_caches`` is False (the CPU) and full parameters are freed by resizing
their storage (``frees_storage_by_resize``).

At stages 1-3 a unit's full parameters are gathered into their storages and freed again after use
(``Unit._alloc`` / ``Unit._free``): at stage 3 twice a step. A GPU's or an NPU's caching allocator
keeps the freed blocks and hands them to the next unit. torch's CPU allocator is glibc's ``malloc``,
which hands every freed block of 32 MiB or more (its largest mmap threshold on 64-bit, fixed) straight
back to the kernel, so the next gather of that size faults its memory in again, 4 KiB at a time,
zeroed by the kernel: at 134M parameters in 64 MiB layers that was a quarter of a stage-3 step
(benchmarks/RESULTS.md, "Layers of 32 MiB and more on CPUs").

The pool keeps such blocks itself. A freed storage's memory is moved into a holder storage
(``UntypedStorage._swap_data_ptr_``: the parameter keeps its storage object, which autograd's saved
tensors share, exactly as after ``resize_(0)``), and the next allocation of the same byte size takes
it back the same way. Smaller blocks are left to ``malloc``, which already reuses them. The pool
holds at most ``limit`` bytes (``make_room``: two of the largest unit's, for the unit in use and the
one gathered ahead), the least recently freed dropped first; what it holds is reported in
``state_bytes`` as ``pooled``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

#: blocks of this size and more are handed back to the kernel by glibc's malloc when freed
MIN_POOLED_BYTES = 32 * 2**20


def can_pool() -> bool:
    """Does this torch let a storage's memory be moved to another storage object?"""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class StoragePool:
    """Memory of freed full-parameter storages (``MIN_POOLED_BYTES`` or more), by byte size."""

    def __init__(self, limit: int = 0) -> None:
        #: the most bytes held at once (0: hold nothing)
        self.limit = limit
        self._held: OrderedDict[int, list[torch.UntypedStorage]] = OrderedDict()
        self.bytes_held = 0

    def make_room(self, units: list[list[int]]) -> None:
        """Hold at most two units' worth (the unit in use and the one gathered ahead) of the largest
        unit, given each unit's full-parameter byte sizes."""
        self.limit = 2 * max((sum(n for n in unit if n >= MIN_POOLED_BYTES) for unit in units), default=0)

    def wants(self, nbytes: int) -> bool:
        """Is a block of ``nbytes`` one the pool keeps?"""
        return nbytes >= MIN_POOLED_BYTES and nbytes <= self.limit

    def free(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory (the storage is left empty, as by ``resize_(0)``)."""
        nbytes = storage.nbytes()
        if not self.wants(nbytes):
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)  # type: ignore[attr-defined]  # private, see the module docstring
        self._held.setdefault(nbytes, []).append(holder)
        self._held.move_to_end(nbytes)
        self.bytes_held += nbytes
        while self.bytes_held > self.limit:  # the least recently freed size goes first
            size, holders = next(iter(self._held.items()))
            holders.pop(0)
            self.bytes_held -= size
            if not holders:
                del self._held[size]

    def alloc(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory: a held block of that size, or new memory."""
        holders = self._held.get(nbytes)
        if not holders:
            storage.resize_(nbytes)
            return
        storage._swap_data_ptr_(holders.pop())  # type: ignore[attr-defined]
        self.bytes_held -= nbytes
        if not holders:
            del self._held[nbytes]
