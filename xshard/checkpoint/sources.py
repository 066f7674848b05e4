"""Full-shape tensors read by dim-0 rows from other tools' files: a state dict in memory (or
memory-mapped from a ``.bin`` file), a safetensors file, a torch.distributed.checkpoint (DCP) folder.

They are ``formats.TensorSource`` objects, so a foreign checkpoint goes through the same key, shape
and optimizer checks as xshard's own. A DCP folder is read through a load planner that asks DCP for
exactly this rank's rows of each tensor, resharded from however the saving ranks held them, in this
process alone (``no_dist``: no collective, whatever process group is running); its non-tensor items
go through ``torch.load(weights_only=True)``. Its ``.metadata`` pickle is read with only DCP's
metadata types allowed (``dcp_metadata.py``): no code from the folder runs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from .dcp_metadata import read_metadata, safe_reader
from .files import CheckpointError

#: safetensors' dtype names (``get_dtype()``) of the dtypes a checkpoint holds
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class DictSource:
    """Full tensors of a state dict (memory-mapped from a ``.bin`` file), read by rows."""

    def __init__(self, folder: Path, tensors: dict[str, torch.Tensor], file: Path | None = None) -> None:
        self.folder, self.tensors = folder, tensors
        #: the file the tensors came from, named in errors (the folder when there is no one file)
        self.file = file if file is not None else folder

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype | None:
        """The stored dtype of ``key`` (None when the source cannot tell)."""
        return self.tensors[key].dtype

    def info(self, key: str) -> dict[str, Any]:
        return {}

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        t = self.tensors[key]
        return (t.reshape(1) if t.dim() == 0 else t[start:stop]).clone()  # own memory, not the mapped file


class SafetensorsSource(DictSource):
    """Tensors of a safetensors file, read by rows (only those rows are read)."""

    def __init__(self, folder: Path, file: Path) -> None:
        from safetensors import safe_open

        try:
            self.handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file ({exc}); save it again") from exc
        self.folder, self.file = folder, file

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype | None:
        return _SAFETENSORS_DTYPES.get(self.handle.get_slice(key).get_dtype())

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        if not self.shape(key):
            return self.handle.get_tensor(key).reshape(1)
        return self.handle.get_slice(key)[start:stop]


class SafetensorsFilesSource(DictSource):
    """Tensors of a model saved in several safetensors files (``model.safetensors.index.json``'s ``weight_map``:
    each key's file), read by rows."""

    def __init__(self, folder: Path, files: dict[str, Path]) -> None:
        self.folder, self.file = folder, folder
        opened = {path: SafetensorsSource(folder, path) for path in sorted(set(files.values()))}
        self.by_key = {key: opened[path] for key, path in files.items()}

    def keys(self) -> list[str]:
        return list(self.by_key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.by_key[key].shape(key)

    def dtype(self, key: str) -> torch.dtype | None:
        return self.by_key[key].dtype(key)

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        return self.by_key[key].rows(key, start, stop, where)


class DcpSource(DictSource):
    """Tensors of a torch.distributed.checkpoint folder under one prefix path (``("model",)`` or
    ``("optimizer", "state")``), named as the state dict names them, read by rows."""

    def __init__(self, folder: Path, prefix: tuple[str, ...]) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = self.file = folder
        try:
            self.metadata = read_metadata(folder)
        except Exception as exc:
            raise CheckpointError(f"{folder}: not a readable torch.distributed.checkpoint folder ({exc})") from exc
        self.by_name: dict[str, str] = {}  # our name -> DCP's flattened key
        self.byte_keys: dict[tuple[Any, ...], str] = {}
        paths = self.metadata.planner_data or {}
        for key, md in self.metadata.state_dict_metadata.items():
            path = tuple(paths.get(key, (key,)))
            if path[:len(prefix)] != prefix:
                continue
            rest = path[len(prefix):]
            if isinstance(md, TensorStorageMetadata):
                self.by_name["/".join(map(str, rest))] = key
            else:
                self.byte_keys[rest] = key

    def keys(self) -> list[str]:
        return list(self.by_name)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[self.by_name[key]].size)

    def dtype(self, key: str) -> torch.dtype | None:
        return self.metadata.state_dict_metadata[self.by_name[key]].properties.dtype

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        out = _dcp_read(self.folder, {self.by_name[key]: (start, stop)}, [])
        value = out[self.by_name[key]]
        return value.reshape(1) if value.dim() == 0 else value

    def read_bytes(self, keys: list[str]) -> dict[str, Any]:
        """Non-tensor items (param groups' hyperparameters), through ``torch.load(weights_only=True)``."""
        return _dcp_read(self.folder, {}, keys)


def _dcp_read(folder: Path, rows: dict[str, tuple[int, int]], byte_keys: list[str]) -> dict[str, Any]:
    """Rows ``[start, stop)`` of DCP tensors and whole byte items, read in this process alone."""
    from torch.distributed.checkpoint import CheckpointException, load
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RowsPlanner(LoadPlanner):
        """Asks DCP for one row range of each tensor (DCP reshards from the saved chunks)."""

        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            self.metadata = metadata
            self.out: dict[str, Any] = {}

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, (start, stop) in rows.items():
                md = self.metadata.state_dict_metadata[key]
                shape = tuple(md.size)
                local = (stop - start, *shape[1:]) if shape else ()
                self.out[key] = torch.empty(local, dtype=md.properties.dtype)
                offsets = (start, *[0] * (len(shape) - 1)) if shape else ()
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local))
                items += create_read_items_for_chunk_list(key, md, [chunk])
            for key in byte_keys:
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                      dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                      storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
            return LoadPlan(items)

        def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
            return global_plan

        def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
            return central_plan

        def load_bytes(self, read_item: ReadItem, value: Any) -> None:
            self.out[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            t = self.out[read_item.dest_index.fqn]
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
                t = t.narrow(dim, offset, length)
            return t

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            pass  # resolve_tensor handed out views of the output: the data is already in place

    planner = RowsPlanner()
    try:
        with warnings.catch_warnings():  # this rank reads alone on purpose: no_dist
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load({}, storage_reader=safe_reader(folder), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's own error is a BaseException
        keys = sorted(rows) or sorted(byte_keys)
        raise CheckpointError(f"{_data_files(folder, keys)}: cannot read {keys} ({_reason(exc)}); the folder is "
                              "damaged or incomplete: load another checkpoint, or save this one again") from exc
    return planner.out


def _data_files(folder: Path, keys: list[str]) -> str:
    """The data files of a DCP folder that hold ``keys`` (the folder itself when the metadata cannot say)."""
    try:
        storage = read_metadata(folder).storage_data or {}
    except Exception:
        return str(folder)
    names = sorted({info.relative_path for index, info in storage.items() if getattr(index, "fqn", None) in keys})
    return ", ".join(str(folder / name) for name in names) or str(folder)


def _reason(exc: BaseException) -> str:
    """One line for a failure of DCP's reader: the first rank's own exception, not DCP's wrapper and its
    tracebacks."""
    failures = getattr(exc, "failures", None)  # torch's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    return " ".join(f"{type(exc).__name__}: {exc}".split())
