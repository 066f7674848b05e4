"""Every `xshard` command error is one line naming the fix, never a traceback; outputs are what their
names say (`consolidate x.safetensors` is a file, any other name a folder); files follow the umask."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.distributed import run_workers

from xshard.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _xshard(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "xshard", *argv], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def _one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    err = result.stderr.strip()
    assert result.returncode != 0, result
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"xshard {command}: error: "), err
    return err


def test_config_output_in_a_missing_folder_or_onto_a_folder(tmp_path):
    err = _one_line_error(_xshard("config", "-o", "missing/dir/x.yaml", cwd=tmp_path), "config")
    assert "the folder missing/dir does not exist; create it first (mkdir -p missing/dir)" in err
    err = _one_line_error(_xshard("config", "-o", str(tmp_path), cwd=tmp_path), "config")
    assert f"is a folder: give a file name, e.g. -o {tmp_path / 'xshard.yaml'}" in err


def test_estimate_of_a_broken_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"garbage, not a header length\n")
    err = _one_line_error(_xshard("estimate", "--model", str(tmp_path), cwd=tmp_path), "estimate")
    assert "model.safetensors: not a readable .safetensors file" in err


def test_an_os_error_names_the_path_and_the_fix(tmp_path):
    from xshard.cli import os_error_line

    missing = tmp_path / "no" / "such" / "file"
    line = os_error_line(FileNotFoundError(errno.ENOENT, "No such file or directory", str(missing)))
    assert line == f"{missing}: No such file or directory; the folder {missing.parent} does not exist: create it " \
                   "first, or pick another path"
    line = os_error_line(OSError(errno.ENOSPC, "No space left on device", "/data/x"))
    assert line == "/data/x: No space left on device; free some space, or write somewhere else"


# ---------------------------------------------------------------------- consolidate


class WithConfig(torch.nn.Module):
    """A model with a transformers-like ``config.to_json_string`` (its checkpoint keeps config.json)."""

    class Config:
        def to_json_string(self) -> str:
            return json.dumps({"model_type": "tiny"})

    def __init__(self) -> None:
        super().__init__()
        self.config = self.Config()
        self.lin = torch.nn.Linear(4, 3)


def _save(rank, world_size, folder, umask):
    import xshard

    os.umask(umask)
    acc = xshard.Accelerator(config={"stage": 3, "auto_wrap_policy": "none"}, seed=0)
    model = acc.prepare(WithConfig())
    acc.save_state(folder)
    return {k: v.clone() for k, v in model.full_state_dict().items()}


@pytest.mark.multiprocess
def test_consolidate_output_names_mean_what_they_say_and_files_follow_the_umask(tmp_path):
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    weights = run_workers(_save, 2, str(ckpt), 0o007)[0]
    for path in [ckpt, *ckpt.iterdir()]:  # every file of the checkpoint alike: umask 007
        assert stat.S_IMODE(path.stat().st_mode) == (0o770 if path.is_dir() else 0o660), path

    old = os.umask(0o027)
    try:
        assert main(["consolidate", str(ckpt), str(tmp_path / "out.safetensors")]) == 0
        assert main(["consolidate", str(ckpt), str(tmp_path / "export")]) == 0
    finally:
        os.umask(old)
    single = tmp_path / "out.safetensors"
    assert single.is_file()  # a file, although the model has a config.json
    assert stat.S_IMODE(single.stat().st_mode) == 0o640
    merged = load_file(single)
    assert merged.keys() == weights.keys() and all(torch.equal(merged[k], v) for k, v in weights.items())
    export = tmp_path / "export"
    assert sorted(os.listdir(export)) == ["config.json", "model.safetensors"]
    assert all(stat.S_IMODE((export / n).stat().st_mode) == 0o640 for n in os.listdir(export))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # written atomically: no leftovers


def test_consolidate_errors_are_one_line(tmp_path):
    (tmp_path / "half").mkdir()
    err = _one_line_error(_xshard("consolidate", str(tmp_path / "half"), "out.safetensors", cwd=tmp_path),
                          "consolidate")
    assert "xshard_state.json is missing" in err
    err = _one_line_error(_xshard("consolidate", str(tmp_path / "hlaf"), "out.safetensors", cwd=tmp_path),
                          "consolidate")
    assert f"no such checkpoint folder (did you mean {str(tmp_path / 'half')!r}?)" in err
    (tmp_path / "a_file").write_text("")
    from xshard.checkpoint.consolidate import output_files
    from xshard.checkpoint.files import CheckpointError

    with pytest.raises(CheckpointError, match="exists and is not a folder: give a folder name, or a file name"):
        output_files(tmp_path / "a_file")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="is a folder: give a new .safetensors file name"):
        output_files(tmp_path / "dir.safetensors")
