"""Model and optimizer state in a checkpoint, by ``state_dict_type``: full, local or sharded.

Every tensor is described in the manifest by a *row table* entry: its full shape and dtype and the
pieces that hold it, ``[file, first_row, end_row]`` of dim 0. Loading reads exactly the rows this
rank needs (safetensors slices: nothing else is read into memory), whatever world size wrote them.

- ``full`` (the default): rank 0 writes ``model.safetensors``, a plain state dict that any tool
  loads, gathered one unit at a time to the CPU; the optimizer state is stored by rows, as in
  ``sharded``. Any world size and any stage resume it.
- ``sharded``: each rank writes its own rows of the model (``model.rank{R}.safetensors``): no
  gather, no communication; the optimizer state by rows too. Any world size and any stage resume it.
- ``local``: the model as in ``sharded``, the optimizer state as torch saves it per rank
  (``optimizer.rank{R}.pt``): same world size and stage only. It keeps any optimizer's state
  exactly as it is, which the row format cannot do for state that is not shaped like its parameter
  (see below), so it stays available for such optimizers.
- Hybrid sharding: every shard exists once per replica (shard group); only the first replica's ranks
  write their rows (``LocalPiece.writes``), so each row is stored once and the files read like any
  others (a checkpoint saved in shard groups resumes without them, and the other way round).

Optimizer state by rows (``optimizer.rank{R}.safetensors`` + ``optimizer.groups.pt``): state
tensors shaped like their parameter's shard (Adam's ``exp_avg``, ``exp_avg_sq``) are row pieces of a
full-shape tensor, written once as the model's rows are; replicated state (``step``, and all state
of a replicated parameter) is written whole by rank 0; state of a sharded parameter that is *not*
shaped like its shard (Adafactor's factored row and column statistics) is written by every rank
(every replica too, since each rank reads back its own) under ``<key>/<state>@rank<R>`` and loads
only on the same world size and shard, with an error naming the key elsewhere.

Design note, why "full" stores the optimizer by rows: a default checkpoint must survive a change of
cluster (saved on 8 NPUs, resumed on 4) without the user knowing in advance; gathering the whole
optimizer state to rank 0 as a second plain file would cost 2-3x the model's bytes of rank-0 host
memory and communication at every save, for a file that no other tool reads. The model file is
what tools read, so it stays one plain state dict; the optimizer rows cost nothing to write.

Design note, why not torch.distributed.checkpoint (DCP): DCP's save/load plans are coordinated
through collectives (gather of every rank's plan to rank 0, then scatter), which is what times out
at thousands of ranks over Gloo (2816 NPUs in huggingface/accelerate#4105, which replaced it with
per-rank files for that reason), and its files need DCP to read. Dim-0 row
pieces are all this core's sharding ever produces, so a row table in the manifest describes them
completely: saving is per-rank and communication-free, loading reshards by slicing, every file is a
plain safetensors file, and ``xshard consolidate`` needs no process group.

Reading goes through a ``TensorSource`` (full-shape tensors by key, read by rows), so checkpoints
written by other tools (``foreign.py``, ``sources.py``: Accelerate's FSDP folders) load through the same
checks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from ..sharding.layout import rows_of
from ..sharding.state_dict import local_pieces, tie_partners
from .files import (
    MANIFEST,
    CheckpointError,
    CheckpointMismatchError,
    load_torch,
    verify_file,
)
from .writer import Writer

#: file of the optimizers' param groups when the optimizer state is stored by rows
GROUPS_FILE = "optimizer.groups.pt"
PER_RANK = "@rank"  # suffix of state stored per rank: "<param>/<state>@rank<R>"
_PER_RANK_KEY = re.compile(r"^(.*)@rank(\d+)$")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


def model_file(i: int, rank: int | None = None) -> str:
    """File of model ``i``: the full state dict (rank None) or rank ``rank``'s rows."""
    base = "model" if i == 0 else f"model_{i}"
    return f"{base}.safetensors" if rank is None else f"{base}.rank{rank}.safetensors"


def optimizer_file(i: int, rank: int) -> str:
    """File of rank ``rank``'s rows of optimizer ``i``'s state."""
    return f"optimizer_{i}.rank{rank}.safetensors" if i else f"optimizer.rank{rank}.safetensors"


def _entry(shape: tuple[int, ...], dtype: torch.dtype, pieces: list[list[Any]], **extra: Any) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "pieces": pieces, **extra}


def _rows_view(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``t`` (this rank's rows of an entry) as a CPU tensor of shape (stop - start, *rest)."""
    t = t.detach().to("cpu")
    return t.reshape(stop - start, *t.shape[1:]) if t.dim() else t.reshape(stop - start)


# ---------------------------------------------------------------------- writing


def write_full_model(writer: Writer, i: int, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rank 0: the gathered state dict as one safetensors file; returns its row table. A tied weight (one
    tensor under several names) is stored once, under its first name, as transformers saves it."""
    name = model_file(i)
    first_key: dict[int, str] = {}
    stored = {k: v for k, v in weights.items() if first_key.setdefault(id(v), k) == k}
    writer.safetensors(name, stored)
    return {k: ({"same_as": first_key[id(v)]} if k not in stored
                else _entry(tuple(v.shape), v.dtype, [[name, 0, rows_of(tuple(v.shape))]]))
            for k, v in weights.items()}


def write_model_rows(writer: Writer, i: int, model: Any) -> dict[str, Any]:
    """This rank's rows of every entry (replicated ones from rank 0 only); returns this rank's table."""
    name = model_file(i, writer.rank)
    tensors: dict[str, torch.Tensor] = {}
    table: dict[str, Any] = {}
    first_key: dict[int, str] = {}
    for key, piece in local_pieces(model).items():
        owner = first_key.setdefault(id(piece.tensor), key)
        if owner != key:  # tied: stored once, loaded under each name
            table[key] = {"same_as": owner}
            continue
        mine = piece.writes and piece.stop > piece.start
        table[key] = _entry(piece.shape, piece.tensor.dtype,
                            [[name, piece.start, piece.stop]] if mine else [])
        if mine:
            tensors[key] = _rows_view(piece.tensor, piece.start, piece.stop)
    writer.safetensors(name, tensors)
    return table


def optimizer_param_keys(optimizer: torch.optim.Optimizer, models: list[Any]) -> list[list[str]]:
    """The state-dict key of every parameter of every param group (what reshards optimizer state)."""
    names: dict[int, str] = {}
    for model in models:
        for key, p in model.module.named_parameters():
            names.setdefault(id(p), key)
    out = []
    for g, group in enumerate(optimizer.param_groups):
        keys = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param group {g} holds a parameter of shape {tuple(p.shape)} that is in "
                                 "no prepared model: prepare the model with the optimizer to save it")
            keys.append(names[id(p)])
        out.append(keys)
    return out


def write_optimizer_rows(writer: Writer, i: int, optimizer: torch.optim.Optimizer, models: list[Any],
                         world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's rows of optimizer ``i``'s state; returns (row table, groups record for rank 0)."""
    name = optimizer_file(i, writer.rank)
    keys = optimizer_param_keys(optimizer, models)
    pieces = {k: v for model in models for k, v in local_pieces(model).items()}
    tensors: dict[str, torch.Tensor] = {}
    table: dict[str, Any] = {}
    extra: dict[str, dict[str, Any]] = {}
    for group, group_keys in zip(optimizer.param_groups, keys, strict=True):
        for p, key in zip(group["params"], group_keys, strict=True):
            piece = pieces[key]
            for state_name, value in optimizer.state.get(p, {}).items():
                entry_key = f"{key}/{state_name}"
                if not isinstance(value, torch.Tensor):
                    extra.setdefault(key, {})[state_name] = value
                    continue
                fields: dict[str, Any] = {}
                like_param = value.dim() >= 1 and tuple(value.shape) == tuple(p.shape)
                if like_param:
                    shape, start, stop, mine = piece.shape, piece.start, piece.stop, piece.writes
                elif piece.sharded and value.dim() >= 1:  # this rank's own statistics of its shard
                    entry_key += f"{PER_RANK}{writer.rank}"
                    shape, start, stop, mine = tuple(value.shape), 0, rows_of(tuple(value.shape)), True
                    fields = {"world_size": world_size, "shard_rows": [piece.start, piece.stop]}
                else:  # replicated: the same on every rank
                    shape, start, stop, mine = tuple(value.shape), 0, rows_of(tuple(value.shape)), writer.rank == 0
                mine = mine and stop > start
                table[entry_key] = _entry(shape, value.dtype, [[name, start, stop]] if mine else [],
                                          like_param=like_param, **fields)
                if mine:
                    tensors[entry_key] = _rows_view(value, start, stop)
    writer.safetensors(name, tensors)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return table, {"param_groups": groups, "param_keys": keys, "extra": extra}


def merge_tables(fragments: list[dict[str, Any]]) -> dict[str, Any]:
    """One row table from every rank's: pieces concatenated in row order."""
    merged: dict[str, Any] = {}
    for fragment in fragments:
        for key, entry in fragment.items():
            if key not in merged:
                merged[key] = {**entry, **({"pieces": list(entry["pieces"])} if "pieces" in entry else {})}
            elif "pieces" in entry:
                merged[key]["pieces"].extend(entry["pieces"])
    for entry in merged.values():
        if "pieces" in entry:
            entry["pieces"].sort(key=lambda piece: piece[1])
    return merged


# ---------------------------------------------------------------------- reading


class TensorSource(Protocol):
    """Full-shape tensors by key, read by dim-0 rows (an xshard row table, or another tool's files)."""

    folder: Path

    def keys(self) -> list[str]:
        """Every key the source holds."""

    def shape(self, key: str) -> tuple[int, ...]:
        """The full shape of ``key``."""

    def info(self, key: str) -> dict[str, Any]:
        """What the source knows about ``key`` beyond its shape (``like_param``, per-rank fields)."""

    def dtype(self, key: str) -> torch.dtype | None:
        """The stored dtype of ``key`` (None when the source cannot tell)."""

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key``, shape (stop - start, *rest), on the CPU."""


class RowReader:
    """Reads rows of row-table entries from a checkpoint's safetensors files (verified on first use)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], on_bytes: Callable[[int], None] | None = None) -> None:
        self.folder = folder
        self.manifest = manifest
        self.on_bytes = on_bytes
        self._open: dict[str, Any] = {}

    def _file(self, name: str) -> Any:
        if name not in self._open:
            from safetensors import safe_open

            path = verify_file(self.folder, name, self.manifest, self.on_bytes)
            try:
                self._open[name] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from exc
        return self._open[name]

    def rows(self, table: dict[str, Any], key: str, start: int, stop: int, where: str) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``table[key]``, shape (stop - start, *rest), on the CPU."""
        while "same_as" in table[key]:  # tied: stored under its first name
            key = table[key]["same_as"]
        entry = table[key]
        shape = tuple(entry["shape"])
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.folder / MANIFEST}: {where} key {key!r} has dtype {entry['dtype']!r}, "
                                  f"which this reader does not know ({', '.join(_DTYPES)})")
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        covered = start
        for name, lo, hi in entry["pieces"]:
            a, b = max(lo, start), min(hi, stop)
            if a >= b:
                continue
            if a != covered:
                break
            f = self._file(name)
            try:
                piece = f.get_slice(key)
                if len(piece.get_shape()) == 0:
                    part = f.get_tensor(key).reshape(1)[a - lo:b - lo]
                else:
                    part = piece[a - lo:b - lo]
            except Exception as exc:
                raise CheckpointError(f"{self.folder / name}: key {key!r} cannot be read ({exc})") from exc
            if tuple(part.shape[1:]) != tuple(out.shape[1:]):
                raise CheckpointError(f"{self.folder / name}: key {key!r} has rows of shape {tuple(part.shape[1:])}, "
                                      f"{MANIFEST} says {tuple(out.shape[1:])}")
            out[a - start:b - start].copy_(part)
            covered = b
        if covered != stop:
            raise CheckpointError(f"{self.folder}: rows {covered}..{stop} of {where} key {key!r} are in no file of "
                                  "the checkpoint (a rank's file is missing from the manifest)")
        return out


class TableSource:
    """A ``TensorSource`` over one row table of an xshard checkpoint."""

    def __init__(self, reader: RowReader, table: dict[str, Any]) -> None:
        self.reader, self.table, self.folder = reader, table, reader.folder

    def _entry(self, key: str) -> dict[str, Any]:
        entry = self.table[key]
        while "same_as" in entry:
            entry = self.table[entry["same_as"]]
        return entry

    def keys(self) -> list[str]:
        return list(self.table)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def info(self, key: str) -> dict[str, Any]:
        return self._entry(key)

    def dtype(self, key: str) -> torch.dtype | None:
        return _DTYPES.get(str(self._entry(key).get("dtype")))  # an unknown name is refused when it is read

    def rows(self, key: str, start: int, stop: int, where: str) -> torch.Tensor:
        return self.reader.rows(self.table, key, start, stop, where)


def read_model_rows(source: TensorSource, model: Any, where: str) -> dict[str, torch.Tensor]:
    """This rank's rows of every model entry, checked against the model (keys, shapes); nothing is changed."""
    pieces = local_pieces(model)
    available = set(source.keys())
    # a tied weight stored under one of its names (Accelerate, transformers) is read for each name
    stored_as = {key: next((k for k in others if k in available), key)
                 for key, others in tie_partners(model.module).items() if key not in available}
    missing = [k for k in pieces if k not in available and stored_as.get(k, k) not in available]
    unexpected = [k for k in source.keys() if k not in pieces]
    if missing or unexpected:
        key = (missing or unexpected)[0]
        raise CheckpointMismatchError(
            f"{source.folder}: {where} does not match the model: key {key!r} is "
            f"{'missing from the checkpoint' if missing else 'not in the model'} (missing keys: {missing[:5]}, "
            f"unexpected keys: {unexpected[:5]}); load a checkpoint of this model")
    out = {}
    for key, piece in pieces.items():
        stored = stored_as.get(key, key)
        shape = source.shape(stored)
        if shape != tuple(piece.shape):
            raise CheckpointMismatchError(
                f"{source_file(source)}: {where} key {key!r} has shape {shape} in the checkpoint, the model's is "
                f"{tuple(piece.shape)}; load a checkpoint of this model")
        dtype = source.dtype(stored)
        if dtype is not None and _kind(dtype) != _kind(piece.tensor.dtype):
            raise CheckpointMismatchError(
                f"{source_file(source)}: {where} key {key!r} is {dtype} in the checkpoint, the model's is "
                f"{piece.tensor.dtype} ({_kind(dtype)} values for a {_kind(piece.tensor.dtype)} tensor); load a "
                "checkpoint of this model")
        out[key] = source.rows(stored, piece.start, piece.stop, where)
    return out


def _check_param_keys(folder: Path, where: str, saved: list[list[str]], keys: list[list[str]]) -> None:
    if keys == saved:
        return
    diff = next((f"group {g} parameter {j}: {a!r} in the checkpoint, {b!r} here"
                 for g, (ga, gb) in enumerate(zip(saved, keys, strict=False))
                 for j, (a, b) in enumerate(zip(ga, gb, strict=False)) if a != b),
                f"{len(saved)} groups of {[len(g) for g in saved]} parameters in the checkpoint, "
                f"{len(keys)} of {[len(g) for g in keys]} here")
    raise CheckpointMismatchError(f"{folder}: {where} has other parameters than this optimizer ({diff}); "
                                  "build the optimizer with the same param groups")


def read_optimizer_rows(source: TensorSource, record: dict[str, Any], optimizer: torch.optim.Optimizer,
                        models: list[Any], where: str, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's optimizer state dict rebuilt from the rows (for ``optimizer.load_state_dict``).

    ``record``: ``param_groups`` (hyperparameters), ``param_keys`` (each group's parameter keys)
    and ``extra`` (non-tensor state by parameter key); ``source`` holds ``<param key>/<state>``.
    """
    keys = optimizer_param_keys(optimizer, models)
    _check_param_keys(source.folder, where, record["param_keys"], keys)
    pieces = {k: v for model in models for k, v in local_pieces(model).items()}
    by_param: dict[str, list[str]] = {}
    for entry_key in source.keys():
        by_param.setdefault(entry_key.rsplit("/", 1)[0], []).append(entry_key)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, group_keys in zip(record["param_groups"], keys, strict=True):
        ids = []
        for key in group_keys:
            values: dict[str, Any] = dict(record["extra"].get(key, {}))
            for entry_key in by_param.get(key, []):
                name = entry_key.rsplit("/", 1)[1]
                value = _optimizer_value(source, entry_key, name, pieces[key], where, rank, world_size)
                if value is not None:
                    values[_PER_RANK_KEY.sub(r"\1", name)] = value
            if values:
                state[index] = values
            ids.append(index)
            index += 1
        groups.append({**group, "params": ids})
    return {"state": state, "param_groups": groups}


#: optimizer state that every optimizer keeping it (torch.optim's, transformers', Accelerate's) keeps in
#: the shape of its parameter: a foreign checkpoint's value of another shape belongs to another model
_LIKE_PARAM_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                               "acc_delta", "sum", "grad_avg", "ax", "prev", "step_size", "exp_inf"})


def source_file(source: TensorSource) -> Path:
    """The file a source's tensors came from (its folder when they are spread over several files)."""
    return Path(getattr(source, "file", source.folder))


def _kind(dtype: torch.dtype) -> str:
    return "complex" if dtype.is_complex else "floating-point" if dtype.is_floating_point else "integer or bool"


def _check_foreign_state(source: TensorSource, entry_key: str, name: str, piece: Any, where: str) -> None:
    """Another tool's optimizer state checked against its parameter before anything is loaded: a state that
    is shaped like its parameter in every optimizer must have that shape, and a float parameter's state
    must be floating-point (``step`` aside)."""
    shape, param_key = source.shape(entry_key), entry_key.rsplit("/", 1)[0]
    fix = "load the optimizer state saved with this model and optimizer"
    if name in _LIKE_PARAM_STATE and shape != tuple(piece.shape):
        raise CheckpointMismatchError(
            f"{source_file(source)}: {where} key {entry_key!r} has shape {shape}, but the parameter {param_key!r} "
            f"has shape {tuple(piece.shape)} (an {name!r} is always shaped like its parameter); {fix}")
    dtype = getattr(source, "dtype", lambda key: None)(entry_key)
    param_dtype = piece.tensor.dtype
    if (dtype is not None and name != "step" and name in _LIKE_PARAM_STATE
            and _kind(dtype) != _kind(param_dtype)):
        raise CheckpointMismatchError(
            f"{source_file(source)}: {where} key {entry_key!r} is {dtype}, but the parameter {param_key!r} is "
            f"{param_dtype} ({_kind(dtype)} state for a {_kind(param_dtype)} parameter); {fix}")


def _optimizer_value(source: TensorSource, entry_key: str, name: str, piece: Any, where: str, rank: int,
                     world_size: int) -> torch.Tensor | None:
    """One state tensor for this rank: its rows, the whole (replicated) tensor, or its own per-rank one."""
    shape, info = source.shape(entry_key), source.info(entry_key)
    if "like_param" not in info and "world_size" not in info:  # another tool's checkpoint
        _check_foreign_state(source, entry_key, name, piece, where)
    per_rank = _PER_RANK_KEY.match(name)
    if per_rank is not None:
        if int(per_rank.group(2)) != rank:
            return None
        saved = (info.get("world_size"), list(info.get("shard_rows", [])))
        if saved != (world_size, [piece.start, piece.stop]):
            raise CheckpointMismatchError(
                f"{source.folder}: {where} key {entry_key!r} is optimizer state that is not shaped like its "
                f"parameter's shard (saved by each of {saved[0]} ranks for rows {saved[1]}; this rank holds rows "
                f"[{piece.start}, {piece.stop}] of {world_size}): it cannot be resharded; resume with the world "
                "size and stage that saved it")
        return source.rows(entry_key, 0, rows_of(shape), where).reshape(shape)
    like_param = info.get("like_param")
    if like_param is None:  # another tool's checkpoint: shaped like the whole parameter
        like_param = len(shape) >= 1 and shape == tuple(piece.shape)
    if like_param:
        if shape != tuple(piece.shape):
            raise CheckpointMismatchError(
                f"{source.folder}: {where} key {entry_key!r} has shape {shape}, the parameter's is "
                f"{tuple(piece.shape)}")
        return source.rows(entry_key, piece.start, piece.stop, where).reshape(piece.tensor.shape)
    if piece.sharded and len(shape) >= 1 and world_size > 1:
        raise CheckpointMismatchError(
            f"{source.folder}: {where} key {entry_key!r} (shape {shape}) is optimizer state that is not shaped "
            f"like its parameter {tuple(piece.shape)}, so it cannot be split over this rank's shard; load it at "
            "stage 0 or on one process")
    return source.rows(entry_key, 0, rows_of(shape), where).reshape(shape)


def check_same_job(manifest: dict[str, Any], now: dict[str, Any], folder: Path, keys: tuple[str, ...]) -> None:
    """Raise naming the manifest key where this job differs from the one that saved."""
    for key in keys:
        if manifest.get(key) != now[key]:
            raise CheckpointMismatchError(
                f"{folder / MANIFEST}: key {key!r} is {manifest.get(key)!r} in the checkpoint but {now[key]!r} in this "
                f"job; a {manifest.get('state_dict_type')!r} checkpoint of format {manifest.get('format_version')} "
                "keeps each rank's optimizer state as it was and resumes only with the same world size, shard "
                "groups, stage and prepared objects (save with the default state_dict_type='full' or 'sharded' to "
                "change them)")


def load_rank_optimizers(folder: Path, manifest: dict[str, Any], rank: int,
                         on_bytes: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """The per-rank optimizer state dicts of a local checkpoint (or a full one of format 2)."""
    return load_torch(folder, f"optimizer.rank{rank}.pt", manifest, on_bytes)
