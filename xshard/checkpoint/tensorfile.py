"""Writing files in one pass: safetensors from CPU tensors, ``torch.save`` data, text; checksums as they go.

Design note, why xshard writes safetensors itself: ``safetensors.torch.save_file`` builds the whole
file in memory, creates it with mode 0600 whatever the user's umask, and gives no progress; a
checksum then needs a second full read of a file that may be tens of GB. The format is small (an
8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
then the raw little-endian bytes, back to back), so ``write_safetensors`` streams each tensor's
bytes straight to the file, updating the checksum (``checksum.py``) and a progress callback on the
way, and the file is created by ``open`` like every other file xshard writes (the user's umask
applies). Files are read back with the ``safetensors`` package, which checks the header.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

import torch

from .checksum import new_hasher

__all__ = ["PT_METADATA", "HashingFile", "SAFETENSORS_DTYPES", "atomic_path", "safetensors_header", "tensor_bytes",
           "write_bytes", "write_safetensors"]

#: torch dtype -> safetensors dtype name (the names the safetensors format defines)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_CHUNK = 64 << 20  # bytes per write: progress moves and memory stays flat on multi-GB tensors


class BinaryWriter(Protocol):
    """What ``HashingFile`` writes to: an open binary file, or ``direct_io.BlockWriter``."""

    def write(self, data: Any, /) -> int | None: ...

    def flush(self) -> None: ...


class HashingFile:
    """A binary file object that keeps the checksum (``checksum.WRITTEN``) and the size of everything written
    through it."""

    def __init__(self, file: BinaryWriter, on_bytes: Callable[[int], None] | None = None) -> None:
        self.file = file
        self.hash = new_hasher()
        self.bytes = 0
        self.on_bytes = on_bytes

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        written = self.file.write(view)
        self.bytes += len(view)
        if self.on_bytes is not None:
            self.on_bytes(len(view))
        return written if written is not None else len(view)

    def flush(self) -> None:
        self.file.flush()

    def hexdigest(self) -> str:
        """The hex checksum of all bytes written so far."""
        return self.hash.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its own device (little-endian, as safetensors stores
    them); a view where the tensor is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)


#: the metadata every safetensors file of xshard's carries (transformers' ``from_pretrained`` looks for it)
PT_METADATA = {"format": "pt"}


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file before its data: the header's length, then the JSON header naming
    each tensor's dtype, shape and byte range (in the order of ``tensors``), padded to 8 bytes."""
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("writing safetensors needs a little-endian machine")
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, tensor in tensors.items():
        dtype = SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store "
                            f"(use one of {', '.join(str(d).removeprefix('torch.') for d in SAFETENSORS_DTYPES)})")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def write_safetensors(out: HashingFile | IO[bytes], tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (any device; copied to the CPU one tensor at a time) as a safetensors file."""
    out.write(safetensors_header(tensors, metadata))
    for tensor in tensors.values():
        write_bytes(out, tensor_bytes(tensor.to("cpu")))


def write_bytes(out: HashingFile | IO[bytes], data: torch.Tensor) -> None:
    """Write a flat uint8 CPU tensor's bytes as they are, in pieces (progress moves, and each piece of a
    page-aligned ``data`` starts page-aligned: ``direct_io.BlockWriter`` then writes it without a copy)."""
    for start in range(0, data.numel(), _CHUNK):
        out.write(data[start:start + _CHUNK].numpy())  # type: ignore[call-overload]  # a bytes-like buffer


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the partial files an ``atomic_path(target)`` of an earlier process left when it was killed (its
    ``.NAME.<pid>.tmp``, owned by this user, its pid no longer alive); returns what was removed. Another user's,
    or a live process's (a run writing it now), is left alone."""
    removed: list[Path] = []
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(\d+)\.tmp$")
    try:
        candidates = list(target.parent.iterdir()) if target.parent.is_dir() else []
    except OSError:
        return removed
    for path in candidates:
        found = pattern.match(path.name)
        if found is None or not path.is_file() or path.is_symlink():
            continue
        try:
            if path.stat().st_uid != os.getuid() or _alive(int(found.group(1))):
                continue
            path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A temporary path beside ``target`` that replaces ``target`` when the block ends without error.

    A crash or an error leaves ``target`` as it was (and no temporary file behind on error).
    """
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
