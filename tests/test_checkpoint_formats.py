"""Checkpoint formats as objects (``xshard/checkpoint/format_registry.py``), on a single-process job:

- a format registered at run time (one object writing one file) is saved and resumed through
  ``Accelerator.save_state`` / ``load_state``, nothing else changed: a new format is one file and one
  registration;
- ``planned_files`` (a dry run's writer that only counts) names exactly the files a real save writes, with
  their bytes, for each of ``full``, ``sharded`` and ``local``;
- a folder that no format recognises (no manifest, no other tool's files) is the error it always was.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import _job, _steps

from xshard.checkpoint import format_registry
from xshard.checkpoint.files import CheckpointError, load_torch, read_manifest
from xshard.checkpoint.formats import read_model_rows
from xshard.checkpoint.load_plan import LoadPlan
from xshard.checkpoint.save_load import planned_files
from xshard.checkpoint.sources import DictSource
from xshard.checkpoint.writer import Writer


class _OneFileFormat:
    """A toy format: the step and the first model's full state dict in one ``toy.pt``; nothing else."""

    name = "one-file"

    def write(self, job: Any, writer: Writer) -> dict[str, Any]:
        weights = job.models[0].full_state_dict()
        if job.is_main_process:
            writer.torch("toy.pt", {"step": job.step, "weights": weights})
        return {}

    def read(self, job: Any, folder: Path, on_bytes: Callable[[int], None] | None = None) -> LoadPlan:
        state = load_torch(folder, "toy.pt", read_manifest(folder), on_bytes)
        source = DictSource(folder, state["weights"], folder / "toy.pt")
        return LoadPlan(step=state["step"], models=[read_model_rows(source, job.models[0], "model 0")],
                        optimizers=[None] * len(job.optimizers))


@pytest.fixture
def one_file_format() -> Iterator[_OneFileFormat]:
    fmt = _OneFileFormat()
    format_registry.register(fmt)
    try:
        yield fmt
    finally:
        format_registry.unregister(fmt.name)
    assert fmt.name not in format_registry.state_dict_types()


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.full_state_dict().items()}


def test_a_registered_format_saves_and_resumes_through_the_accelerator(one_file_format, tmp_path):
    acc, model, opt, loader, sched = _job(1)
    _steps(acc, model, opt, loader, sched, 2)
    saved_weights, saved_step = _weights(model), acc.step
    path = acc.save_state(tmp_path / "checkpoint-2", state_dict_type="one-file")
    assert sorted(p.name for p in path.iterdir()) == ["toy.pt", "xshard_state.json"]
    assert read_manifest(path)["state_dict_type"] == "one-file"
    _steps(acc, model, opt, loader, sched, 2)
    assert acc.step == saved_step + 2
    assert not all(torch.equal(v, saved_weights[k]) for k, v in _weights(model).items())
    assert acc.load_state(path) == path
    assert acc.step == saved_step
    loaded = _weights(model)
    assert loaded.keys() == saved_weights.keys()
    assert all(torch.equal(v, saved_weights[k]) for k, v in loaded.items())


def test_an_unregistered_state_dict_type_is_refused_naming_the_registered_ones(tmp_path):
    acc, *_ = _job(1)
    with pytest.raises(ValueError, match=r"state_dict_type='one-file': use one of full, local, sharded"):
        acc.save_state(tmp_path / "checkpoint-1", state_dict_type="one-file")
    assert not (tmp_path / "checkpoint-1").exists()


def _data_bytes(path: Path) -> int:
    """A file's bytes as ``planned_files`` counts them: a safetensors file's tensors without its header."""
    size = path.stat().st_size
    if path.suffix != ".safetensors":
        return size
    (header,) = struct.unpack("<Q", path.read_bytes()[:8])
    return size - 8 - header


@pytest.mark.parametrize("kind", ["full", "sharded", "local"])
def test_planned_files_are_the_files_a_save_writes(kind, tmp_path):
    acc, model, opt, loader, sched = _job(1, state_dict_type=kind)
    _steps(acc, model, opt, loader, sched, 2)
    planned = planned_files(acc.job, kind)
    path = acc.save_state(tmp_path / "checkpoint-2")
    written = json.loads((path / "xshard_state.json").read_text())["files"]
    assert sorted(planned) == sorted(written)
    assert {name: _data_bytes(path / name) for name in written} == planned
    assert all(planned[name] > 0 for name in planned)
    model_file = "model.safetensors" if kind == "full" else "model.rank0.safetensors"
    assert planned[model_file] == sum(v.numel() * v.element_size() for v in model.full_state_dict().values())


def test_a_folder_no_format_recognises_is_the_missing_manifest_error(tmp_path):
    acc, *_ = _job(1)
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a checkpoint")
    assert format_registry.foreign_format(folder) is None
    with pytest.raises(CheckpointError, match=r"is not a complete xshard checkpoint: xshard_state\.json is missing"):
        acc.load_state(folder)
