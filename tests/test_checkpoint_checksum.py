"""Checkpoint checksums: saves record xxh3-128 (format 4); checkpoints of format 3 and before, whose
manifests name sha256, still load, and a changed byte is refused under either algorithm."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_checkpoint import _job, _steps
from test_checkpoint_user_files import _rewrite_manifest, _same, _state

from xshard.checkpoint.files import CheckpointError


@pytest.fixture
def job():
    return _job(1, state_dict_type="full")


def _as_format_3(folder: Path) -> None:
    """Rewrite a checkpoint's manifest as an xshard of format 3 wrote it: the same files and tables, each
    file's sha256 in place of its xxh3-128 (the only difference between formats 3 and 4)."""
    def older(manifest):
        manifest["format_version"] = 3
        for name, entry in manifest["files"].items():
            del entry["xxh3_128"]
            entry["sha256"] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    _rewrite_manifest(folder, older)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_save_records_xxh3_128_and_a_changed_byte_is_refused(job, tmp_path):
    acc, model, opt, loader, sched = job
    _steps(acc, model, opt, loader, sched, 2)
    saved = acc.save_state(tmp_path / "checkpoint-2")
    manifest = json.loads((saved / "xshard_state.json").read_text())
    assert manifest["format_version"] == 4
    assert manifest["files"] and all(sorted(e) == ["bytes", "xxh3_128"] for e in manifest["files"].values())
    _flip_a_byte(saved / "model.safetensors")
    before = _state(acc, model, opt, sched)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupted: its xxh3_128 checksum does not "
                                              r"match xshard_state\.json files\['model\.safetensors'\]"):
        acc.load_state(saved)
    assert _same(_state(acc, model, opt, sched), before)


def test_a_format_3_checkpoint_with_sha256_loads_and_refuses_a_changed_byte(job, tmp_path):
    acc, model, opt, loader, sched = job
    _steps(acc, model, opt, loader, sched, 2)
    old = acc.save_state(tmp_path / "old")
    _as_format_3(old)
    at_save = _state(acc, model, opt, sched)
    corrupt = tmp_path / "old-corrupt"
    shutil.copytree(old, corrupt)
    _flip_a_byte(corrupt / "optimizer.rank0.safetensors")
    _steps(acc, model, opt, loader, sched, 2)
    before = _state(acc, model, opt, sched)
    with pytest.raises(CheckpointError, match=r"optimizer\.rank0\.safetensors is corrupted: its sha256 checksum"):
        acc.load_state(corrupt)
    assert _same(_state(acc, model, opt, sched), before)
    acc.load_state(old)
    assert _same(_state(acc, model, opt, sched), at_save)


@pytest.mark.parametrize("entry", [{"bytes": 1}, {"bytes": 1, "xxh3_128": "0" * 64}, {"bytes": 1, "crc32": "0" * 8},
                                   {"bytes": 1, "sha256": "0" * 64, "xxh3_128": "0" * 32}])
def test_a_files_entry_without_exactly_one_known_checksum_is_refused(job, tmp_path, entry):
    acc, *_ = job
    saved = acc.save_state(tmp_path / "ckpt")
    _rewrite_manifest(saved, lambda m: m["files"].update({"model.safetensors": entry}))
    with pytest.raises(CheckpointError, match=r"files\['model\.safetensors'\] is .*expected \{'bytes': <size>, "
                                              r"'xxh3_128': <32 hex digits>\} \(or 'sha256'"):
        acc.load_state(saved)
