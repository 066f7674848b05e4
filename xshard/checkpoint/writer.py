"""The seam every checkpoint file goes through: the ``Writer`` protocol, and ``SizeWriter``, which only counts.

Three writers satisfy ``Writer``: ``files.FileWriter`` (a blocking save's files on disk),
``async_save.StagingWriter`` (an async save's files copied to host memory, written later) and
``SizeWriter`` here (each file's name and bytes, written nowhere: ``save_load.planned_files``, a dry run).
A checkpoint format (``format_protocol.CheckpointFormat``) writes through whichever it is given and asks
``counts_only`` where counting may skip work (a ``full`` checkpoint's gather of the whole model).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .tensorfile import PT_METADATA


class Writer(Protocol):
    """Where one rank's checkpoint files go, one call per file."""

    #: the rank whose files these are (it names the per-rank files)
    rank: int

    @property
    def counts_only(self) -> bool:
        """True when the files are only counted (no byte is kept): a format may then pass stand-in tensors
        (``device="meta"``) of the right shapes and dtypes instead of gathering real ones."""
        ...

    @property
    def files(self) -> Mapping[str, object]:
        """The files written (or recorded) so far, by name."""
        ...

    def safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] = PT_METADATA) -> None:
        """Write tensors as a safetensors file."""
        ...

    def torch(self, name: str, obj: Any) -> None:
        """Write plain data and tensors with ``torch.save`` (read back with ``weights_only=True``)."""
        ...

    def text(self, name: str, text: str) -> None:
        """Write a text file."""
        ...


class SizeWriter:
    """A ``Writer`` that writes nothing: each file's name and bytes (safetensors: the tensors' bytes, without the
    small header; ``torch.save`` files serialised in memory; text: its UTF-8 bytes)."""

    counts_only = True

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.files: dict[str, int] = {}

    def safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] = PT_METADATA) -> None:
        """Count the tensors' bytes (meta tensors count as the real ones would)."""
        self.files[name] = sum(t.numel() * t.element_size() for t in tensors.values())

    def torch(self, name: str, obj: Any) -> None:
        """Count the bytes ``torch.save`` writes."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        self.files[name] = buffer.tell()

    def text(self, name: str, text: str) -> None:
        """Count the text's UTF-8 bytes."""
        self.files[name] = len(text.encode())
