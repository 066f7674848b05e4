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


class DictSource:
    """Full tensors of a state dict (memory-mapped from a ``.bin`` file), read by rows."""

    def __init__(self, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.folder, self.tensors = folder, tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def info(self, key: str) -> dict[str, Any]:
        return {}

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        t = self.tensors[key]
        return (t.reshape(1) if t.dim() == 0 else t[start:stop]).clone()  # own memory, not the mapped file


class SafetensorsSource(DictSource):
    """Tensors of a safetensors file, read by rows (only those rows are read)."""

    def __init__(self, folder: Path, file: Path) -> None:
        from safetensors import safe_open

        self.folder, self.handle = folder, safe_open(str(file), framework="pt", device="cpu")
        self.file = file

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(key).get_shape())

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        if not self.shape(key):
            return self.handle.get_tensor(key).reshape(1)
        return self.handle.get_slice(key)[start:stop]


class DcpSource(DictSource):
    """Tensors of a torch.distributed.checkpoint folder under one prefix path (``("model",)`` or
    ``("optimizer", "state")``), named as the state dict names them, read by rows."""

    def __init__(self, folder: Path, prefix: tuple[str, ...]) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = folder
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

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        out = _dcp_read(self.folder, {self.by_name[key]: (start, stop)}, [])
        value = out[self.by_name[key]]
        return value.reshape(1) if value.dim() == 0 else value

    def read_bytes(self, keys: list[str]) -> dict[str, Any]:
        """Non-tensor items (param groups' hyperparameters), through ``torch.load(weights_only=True)``."""
        return _dcp_read(self.folder, {}, keys)


def _dcp_read(folder: Path, rows: dict[str, tuple[int, int]], byte_keys: list[str]) -> dict[str, Any]:
    """Rows ``[start, stop)`` of DCP tensors and whole byte items, read in this process alone."""
    from torch.distributed.checkpoint import load
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
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot read {sorted(rows) or sorted(byte_keys)} ({exc})") from exc
    return planner.out
