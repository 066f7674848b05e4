"""xshard's own checkpoint formats, one object each: ``FULL``, ``SHARDED`` and ``LOCAL`` (``state_dict_type``).

They differ in two choices only, so one base class holds the rest (the manifest's checks, the row tables,
the files of ``job_files.py``) and each subclass makes its two choices:

- the model: one plain state dict gathered on rank 0 (``full``), or each rank's rows (``sharded``, ``local``);
- the optimizer: by rows, resumable on any world size and stage (``full``, ``sharded``), or each rank's
  state dict as torch saves it (``local``: same world size and stage only).

``formats.py`` says what each layout holds and why.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..sharding.state_dict import local_pieces
from . import formats
from .files import MANIFEST, CheckpointError, load_torch, read_manifest
from .job_files import COUNTS, job_facts, read_job_files, write_job_files
from .load_plan import LoadPlan
from .writer import Writer

if TYPE_CHECKING:
    from ..runtime.job import JobState


class RowTableFormat:
    """An xshard checkpoint: the manifest's row tables for the model and (``optimizer_by_rows``) the optimizer.

    Subclasses set ``name`` and ``optimizer_by_rows`` and may override ``write_models``.
    """

    name = ""
    #: whether the optimizer state is stored by rows (any world size and stage) or per rank as torch saves it
    optimizer_by_rows = True

    def write(self, job: JobState, writer: Writer) -> dict[str, Any]:
        """This rank's files (models, optimizers, then ``job_files``); returns its row tables."""
        tables = self.write_models(job, writer)
        if self.optimizer_by_rows:
            groups = []
            for i, opt in enumerate(job.optimizers):
                tables[f"optimizer{i}"], record = formats.write_optimizer_rows(writer, i, opt.optimizer, job.models,
                                                                               job.world_size)
                groups.append(record)
            if job.is_main_process:
                writer.torch(formats.GROUPS_FILE, groups)
        else:
            writer.torch(f"optimizer.rank{job.rank}.pt", [opt.state_dict() for opt in job.optimizers])
        write_job_files(job, writer)
        return tables

    def write_models(self, job: JobState, writer: Writer) -> dict[str, Any]:
        """This rank's rows of every model (replicated entries from rank 0 only); returns their tables."""
        return {f"model{i}": formats.write_model_rows(writer, i, model) for i, model in enumerate(job.models)}

    def optimizer_rows_in(self, manifest: dict[str, Any]) -> bool:
        """Whether the checkpoint of this ``manifest`` stores the optimizer by rows."""
        return self.optimizer_by_rows

    def read(self, job: JobState, folder: Path, on_bytes: Callable[[int], None] | None = None) -> LoadPlan:
        """Read and check all this rank needs from the checkpoint; change nothing."""
        manifest = read_manifest(folder)
        by_rows = self.optimizer_rows_in(manifest)
        if by_rows:
            formats.check_same_job(manifest, job_facts(job), folder, COUNTS)
        else:  # each rank's optimizer state as it was, in its shard groups
            formats.check_same_job(manifest, job_facts(job), folder, ("world_size", "shard_group_size", "stage",
                                                                      *COUNTS))
        reader = formats.RowReader(folder, manifest, on_bytes)
        tables = manifest.get("tables", {})
        models: list[dict[str, torch.Tensor] | None] = []
        for i, model in enumerate(job.models):
            table = tables.get(f"model{i}")
            if table is None:
                raise CheckpointError(f"{folder / MANIFEST}: key 'tables' has no 'model{i}'")
            models.append(formats.read_model_rows(formats.TableSource(reader, table), model, f"model {i}"))
        optimizers: list[dict[str, Any] | None] = []
        if by_rows:
            records = load_torch(folder, formats.GROUPS_FILE, manifest, on_bytes)
            for i, opt in enumerate(job.optimizers):
                source = formats.TableSource(reader, tables.get(f"optimizer{i}", {}))
                optimizers.append(formats.read_optimizer_rows(
                    source, records[i], opt.optimizer, job.models, f"optimizer {i}", job.rank, job.world_size))
        else:
            optimizers.extend(formats.load_rank_optimizers(folder, manifest, job.rank, on_bytes))
        return read_job_files(job, folder, manifest, models, optimizers, on_bytes)


class FullFormat(RowTableFormat):
    """``full`` (the default): rank 0 writes each model as one plain ``model.safetensors``; optimizer by rows."""

    name = "full"

    def write_models(self, job: JobState, writer: Writer) -> dict[str, Any]:
        """Each model gathered (every rank takes part) and written by rank 0; a writer that only counts gets
        stand-ins of the full shapes instead (a dry run of a large model could not hold it whole)."""
        tables: dict[str, Any] = {}
        for i, model in enumerate(job.models):
            if writer.counts_only:
                if job.is_main_process:
                    tables[f"model{i}"] = formats.write_full_model(writer, i, _stand_ins(model))
                continue
            weights = model.full_state_dict(rank0_only=True)  # every rank takes part; complete on rank 0
            if job.is_main_process:
                tables[f"model{i}"] = formats.write_full_model(writer, i, weights)
            del weights
        return tables

    def optimizer_rows_in(self, manifest: dict[str, Any]) -> bool:
        """By rows from format 3 on; format 2 kept each rank's optimizer state dict."""
        return manifest.get("format_version") != 2


def _stand_ins(model: Any) -> dict[str, torch.Tensor]:
    """Meta tensors of the model's full shapes and dtypes, by state-dict key; a tie is one tensor under its
    names (``write_full_model`` then stores it once, as it does the real weights)."""
    by_tensor: dict[int, torch.Tensor] = {}
    return {key: by_tensor.setdefault(id(piece.tensor), torch.empty(piece.shape, dtype=piece.tensor.dtype,
                                                                    device="meta"))
            for key, piece in local_pieces(model).items()}


class ShardedFormat(RowTableFormat):
    """``sharded``: each rank writes its rows of the model; the optimizer by rows. No gather."""

    name = "sharded"


class LocalFormat(RowTableFormat):
    """``local``: the model as ``sharded``; each rank's optimizer state dict as torch saves it."""

    name = "local"
    optimizer_by_rows = False


FULL = FullFormat()
SHARDED = ShardedFormat()
LOCAL = LocalFormat()
