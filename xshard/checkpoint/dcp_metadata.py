"""Reading a torch.distributed.checkpoint (DCP) folder's ``.metadata`` without running code from it.

DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on that file, so a crafted folder runs
whatever its pickle says on every rank that opens it. Design note, which guard: torch's own
restricted unpickler (``weights_only``) cannot read this file at all (DCP writes it with pickle
protocol 4, whose FRAME opcode that unpickler refuses: "Unsupported operand 149"), and an opt-in flag
would leave the default path unsafe. So the file goes through the standard library's unpickler with
``find_class`` limited to DCP's metadata types (dataclasses and one enum), torch's dtypes,
``torch.Size``, the layout lookup torch pickles, and ``pathlib`` paths: the only callables a pickle
can reach. Anything else is refused naming the type. The file names the metadata gives for the data
(``relative_path``) must be plain names inside the folder.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import torch

from .manifest_check import is_plain_name

_DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeMetadataError(pickle.UnpicklingError):
    """The metadata pickle names something other than DCP's metadata types."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_TYPES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return getattr(importlib.import_module(module), name)
        raise UnsafeMetadataError(f"it names {module}.{name}, which is not one of DCP's metadata types "
                                  "(refused: a checkpoint's metadata must not run code)")


def read_metadata(folder: Path) -> Any:
    """The ``Metadata`` of a DCP folder, unpickled with only DCP's metadata types allowed."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    with open(folder / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not is_plain_name(name):
            raise UnsafeMetadataError(f"the data of {getattr(index, 'fqn', index)!r} is said to be in {name!r}, "
                                      "not a plain file name inside the folder")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def safe_reader(folder: Path) -> Any:
    """A DCP ``FileSystemReader`` of ``folder`` whose metadata comes from ``read_metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(folder)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))
