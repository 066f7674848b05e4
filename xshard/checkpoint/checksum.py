"""The checksum of every checkpoint file: the algorithm a save records, the ones a load accepts.

Each ``files`` entry of a manifest names its algorithm by its key: ``{"bytes": <size>, "xxh3_128":
<32 hex digits>}`` since format 4, ``{"bytes": <size>, "sha256": <64 hex digits>}`` before. A load
verifies a file with whichever of the two its entry names, so older checkpoints keep loading.

Design note, why xxh3-128 and not sha256. What the checksum is for: a committed checkpoint whose
bytes changed after the save (bit rot, a truncated or interrupted copy, a file overwritten by hand,
a file from another checkpoint put in its place). Torn writes never reach a committed checkpoint:
every file is fsynced before the manifest is written and the folder renamed into place
(``files.commit``), so a crash mid-write leaves a ``.tmp`` folder that nothing loads; the size in
the manifest catches truncation on its own. Against accidental change, a 128-bit non-cryptographic
hash misses a random corruption with probability 2**-128, as good as sha256 for this purpose. What
sha256 adds is resistance to a forger, and that buys nothing here: whoever can rewrite a file can
rewrite the manifest beside it, and loading is safe against crafted files anyway (safetensors and
``torch.load(weights_only=True)`` only). xxh3-128 hashes about 20 GB/s on one core against sha256's
0.6-1.7 GB/s (SHA-NI) on the same core, which matters twice: a save hashes every byte it writes
(an async save does it on a background thread that competes with CPU training for the cores), and
a load hashes every byte before reading it. zlib's CRC-32 (standard library, about 3 GB/s here) is
32 bits only. ``xxhash`` (python-xxhash >= 3) releases the GIL while it hashes.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import xxhash

__all__ = ["ALGORITHMS", "WRITTEN", "Hasher", "algorithm_of", "file_digest", "new_hasher"]


class Hasher(Protocol):
    """What a hash object offers (hashlib's and xxhash's alike)."""

    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


#: algorithm name (its key in a manifest's files entry) -> (new hash object, hex digest pattern)
ALGORITHMS: dict[str, tuple[Callable[[], Hasher], re.Pattern[str]]] = {
    "xxh3_128": (xxhash.xxh3_128, re.compile(r"[0-9a-f]{32}")),
    "sha256": (hashlib.sha256, re.compile(r"[0-9a-f]{64}")),
}
#: the algorithm every save records (format 4 and later)
WRITTEN = "xxh3_128"
_BLOCK = 8 << 20  # bytes per read when verifying


def new_hasher() -> Hasher:
    """A hash object of the algorithm saves record (``WRITTEN``)."""
    return ALGORITHMS[WRITTEN][0]()


def algorithm_of(entry: dict[str, Any]) -> str | None:
    """The algorithm a manifest's files entry names with a well-formed digest, or None: exactly one is allowed."""
    named = [name for name in ALGORITHMS if name in entry]
    if len(named) != 1:
        return None
    digest = entry[named[0]]
    return named[0] if isinstance(digest, str) and ALGORITHMS[named[0]][1].fullmatch(digest) else None


def file_digest(path: Path, algorithm: str, on_bytes: Callable[[int], None] | None = None) -> str:
    """Hex digest of a file with ``algorithm`` (``on_bytes`` hears of each block's size)."""
    h = ALGORITHMS[algorithm][0]()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return h.hexdigest()
