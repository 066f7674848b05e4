"""save_state never loses a user's file; rotation touches only its own numbered checkpoints; a crash at
any line of a commit or a rotation leaves the previous or the new checkpoint loadable; manifests that
point outside their folder or hold bad values are refused before anything changes (one process)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from support.private_tmpfs import output_lines, run_on_private_tmpfs
from test_checkpoint import _job, _plain, _steps

from xshard.checkpoint import files as ckpt_files
from xshard.checkpoint.files import CheckpointError, CheckpointSaveError


def _user_files(root: Path) -> dict[str, bytes]:
    """What a user keeps in an output folder: logs, a TensorBoard run, notes, a save_pretrained config."""
    made = {"train.log": b"step 1 loss 0.5\n", "runs/events.out.tfevents.1": b"\x00\x01tb", "notes.txt": b"lr=1e-2\n",
            "pretrained/config.json": b'{"model_type": "net"}'}
    for name, data in made.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return made


def _unchanged(root: Path, made: dict[str, bytes]) -> bool:
    return all((root / n).is_file() and (root / n).read_bytes() == d for n, d in made.items())


@pytest.fixture
def job():
    return _job(1, state_dict_type="full")


def _state(acc, model, opt, sched):
    return (_plain(model), {k: {n: v.clone() for n, v in s.items()} for k, s in opt.optimizer.state.items()},
            sched.state_dict(), acc.step)


def _same(a, b) -> bool:
    return (all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and all(torch.equal(v, b[1][p][n]) for p, s in a[1].items() for n, v in s.items())
            and a[2:] == b[2:])


# ---------------------------------------------------------------------- user files


def test_save_state_into_a_folder_with_user_files_keeps_every_one(job, tmp_path):
    acc, model, opt, loader, sched = job
    out = tmp_path / "out"
    out.mkdir()
    made = _user_files(out)
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(out)
    assert _unchanged(out, made)
    first = _state(acc, model, opt, sched)
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(out)  # again into the same folder: the older checkpoint's files are replaced, not the user's
    second = _state(acc, model, opt, sched)
    assert _unchanged(out, made)
    assert not (out.parent / "out.tmp").exists() and not (out.parent / "out.old").exists()
    acc.load_state(out)
    assert _same(_state(acc, model, opt, sched), second) and not _same(first, second)


def test_a_file_a_checkpoint_would_overwrite_is_refused_before_anything_is_written(job, tmp_path):
    acc, model, opt, loader, sched = job
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's exported weights")  # e.g. from save_model
    with pytest.raises(CheckpointSaveError, match=r"model\.safetensors, which xshard did not write.*own folder"):
        acc.save_state(out)
    assert (out / "model.safetensors").read_bytes() == b"the user's exported weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------------- rotation


def test_rotation_deletes_only_its_own_numbered_checkpoints(job, tmp_path):
    acc, model, opt, loader, sched = job
    out = tmp_path / "out"
    acc.save_state(out / "checkpoint-1")
    shutil.copytree(out / "checkpoint-1", out / "best_model")  # a hand-kept copy, with its manifest
    shutil.copytree(out / "checkpoint-1", out / "run_a-1")  # another series
    (out / "checkpoint-1" / "notes.txt").write_text("keep me")  # a user's file inside a checkpoint
    for step in (2, 3, 4):
        _steps(acc, model, opt, loader, sched, 1)
        acc.save_state(out / f"checkpoint-{step}", save_total_limit=2)
    left = sorted(p.name for p in out.iterdir() if p.name != ".xshard_job.lock")  # the running job's lock
    assert left == ["best_model", "checkpoint-1", "checkpoint-3", "checkpoint-4", "run_a-1"], left
    assert [p.name for p in (out / "checkpoint-1").iterdir()] == ["notes.txt"]  # its checkpoint files went
    assert (out / "best_model" / "xshard_state.json").is_file() and (out / "run_a-1" / "xshard_state.json").is_file()
    with pytest.raises(ValueError, match="has no number at its end"):
        acc.save_state(out / "best_model", save_total_limit=2)
    assert (out / "best_model" / "xshard_state.json").is_file()


# ---------------------------------------------------------------------- a crash at every line


class _Killed(BaseException):
    """Stands for the process dying at that line."""


def _crash_at(line: int, functions: set[str]):
    """A trace function that raises _Killed at the ``line``-th line event inside ``functions``."""
    seen = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != ckpt_files.__file__ or frame.f_code.co_name not in functions:
            return None

        def local(frame, event, arg):
            if event == "line":
                seen[0] += 1
                if seen[0] == line:
                    raise _Killed
            return local
        return local
    return tracer, seen


def _save_crashing_at(acc, path, line, functions, **kwargs) -> bool:
    """Save with a crash at ``line``; True when the save ran to the end (line past the last)."""
    tracer, seen = _crash_at(line, functions)
    sys.settrace(tracer)
    try:
        acc.save_state(path, **kwargs)
        return True
    except _Killed:
        return False
    finally:
        sys.settrace(None)


def test_a_crash_at_any_line_of_a_commit_or_a_rotation_leaves_the_previous_or_the_new_checkpoint(job, tmp_path):
    acc, model, opt, loader, sched = job
    functions = {"commit", "_commit_into", "rotate", "remove_folder", "_link_or_copy"}
    trials, line = 0, 1
    while True:
        out = tmp_path / f"trial{line}"
        out.mkdir()
        made = _user_files(out)
        _steps(acc, model, opt, loader, sched, 1)
        acc.save_state(out)  # an older checkpoint in a folder of the user's
        acc.save_state(out / "checkpoint-1")
        acc.save_state(out / "checkpoint-2")
        old = _state(acc, model, opt, sched)
        _steps(acc, model, opt, loader, sched, 1)
        new = _state(acc, model, opt, sched)
        finished = _save_crashing_at(acc, out, line, functions)
        finished &= _save_crashing_at(acc, out / "checkpoint-3", line, functions, save_total_limit=2)
        trials += 1
        assert _unchanged(out, made), line
        # what the next run loads: the folder itself, and the newest of the series
        acc.load_state(out)
        assert _same(_state(acc, model, opt, sched), old) or _same(_state(acc, model, opt, sched), new), line
        acc.load_state(out, resume_from_checkpoint=True)
        resumed = _state(acc, model, opt, sched)
        assert _same(resumed, old) or _same(resumed, new), line
        if finished:
            break
        line += 1
    assert trials > 20  # every line of commit, the commit into a folder, and rotation was a crash point
    print(f"crash points tried during commit and rotation: {trials}, all loadable")


# ---------------------------------------------------------------------- manifests that lie


def _rewrite_manifest(folder: Path, change) -> None:
    path = folder / "xshard_state.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _sha(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_manifest_file_names_must_stay_inside_the_folder(job, tmp_path):
    from xshard.checkpoint.consolidate import consolidated_state_dict

    acc, model, opt, loader, sched = job
    good = acc.save_state(tmp_path / "good")
    outside = tmp_path / "elsewhere" / "model.safetensors"
    outside.parent.mkdir()
    shutil.copy(good / "model.safetensors", outside)
    bad = {}
    for kind, name in (("dotdot", "../elsewhere/model.safetensors"), ("absolute", str(outside))):
        folder = tmp_path / kind
        shutil.copytree(good, folder)

        def point(m, name=name):
            m["files"][name] = m["files"].pop("model.safetensors")
            for entry in m["tables"]["model0"].values():
                for piece in entry["pieces"]:
                    piece[0] = name
        _rewrite_manifest(folder, point)
        bad[kind] = folder
    link = tmp_path / "link"
    shutil.copytree(good, link)
    (link / "model.safetensors").unlink()
    (link / "model.safetensors").symlink_to(outside)
    bad["link"] = link
    passwd = tmp_path / "passwd"
    shutil.copytree(good, passwd)
    _rewrite_manifest(passwd, lambda m: m["files"].update({"/etc/passwd": {"bytes": 1, "sha256": "0" * 64}}))
    bad["passwd"] = passwd
    before = _state(acc, model, opt, sched)
    for kind, folder in bad.items():
        with pytest.raises(CheckpointError, match="plain file name|leads outside") as caught:
            acc.load_state(folder)
        assert "passwd" not in kind or "bytes" not in str(caught.value).split("/etc/passwd")[-1][:40]
        with pytest.raises(CheckpointError, match="plain file name|leads outside"):
            consolidated_state_dict(folder)
    assert _same(_state(acc, model, opt, sched), before)


def test_a_malformed_checkpoint_changes_nothing_and_resume_falls_back_to_the_previous(job, tmp_path, caplog):
    acc, model, opt, loader, sched = job
    out = tmp_path / "out"
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(out / "checkpoint-2")
    at_2 = _state(acc, model, opt, sched)
    _steps(acc, model, opt, loader, sched, 1)
    acc.save_state(out / "checkpoint-3")
    _rewrite_manifest(out / "checkpoint-3", lambda m: m.update(step="abc"))
    shutil.copytree(out / "checkpoint-3", out / "loader-state-3")
    _rewrite_manifest(out / "loader-state-3", lambda m: m.update(step=3))
    # a data-loader state its loader refuses (a checksum that matches: the file was rewritten with its manifest)
    torch.save([{"unexpected": "layout"}], out / "loader-state-3" / "data.pt")
    _rewrite_manifest(out / "loader-state-3", lambda m: m["files"].update({"data.pt": _sha(out / "loader-state-3" /
                                                                                         "data.pt")}))
    _steps(acc, model, opt, loader, sched, 2)
    before = _state(acc, model, opt, sched)
    with pytest.raises(CheckpointError, match="key 'step' is 'abc'"):
        acc.load_state(out / "checkpoint-3")
    assert _same(_state(acc, model, opt, sched), before)
    with pytest.raises(CheckpointError, match="cannot be loaded into it"):
        acc.load_state(out / "loader-state-3")
    assert _same(_state(acc, model, opt, sched), before)  # the scheduler it had already taken was put back
    shutil.rmtree(out / "loader-state-3")
    with caplog.at_level(logging.WARNING, logger="xshard"):
        path = acc.load_state(out, resume_from_checkpoint=True)
    assert Path(path).name == "checkpoint-2" and _same(_state(acc, model, opt, sched), at_2)
    assert any("checkpoint-3" in r.getMessage() and "falling back to the previous checkpoint" in r.getMessage()
               for r in caplog.records)


# ---------------------------------------------------------------------- a full disk


_DISK_FULL_SCRIPT = r'''
import os, sys, torch
sys.path.insert(0, sys.argv[2])
from test_checkpoint import Net
import xshard
from xshard.checkpoint.files import CheckpointSaveError
out = sys.argv[1]
acc = xshard.Accelerator(config={"stage": 0})
model = Net(width=160)  # about 0.2 MB of weights, 0.67 MB with AdamW's state and the rest
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
model(torch.randn(4, 8), torch.randn(4)).backward(); opt.step()
acc.save_state(os.path.join(out, "checkpoint-1"))
try:
    acc.save_state(os.path.join(out, "checkpoint-2"))
    print("SAVED")
except CheckpointSaveError as exc:
    print("ERROR:" + str(exc))
print("LEFT:" + ",".join(sorted(os.listdir(out))))
acc.load_state(os.path.join(out, "checkpoint-1"))
print("LOADED")
'''


def test_a_full_disk_is_one_line_with_bytes_needed_and_free_and_leaves_nothing(tmp_path):
    tests = str(Path(__file__).parent)
    # a 1000 KB tmpfs (one checkpoint takes about 670 KB)
    proc, mount = run_on_private_tmpfs(tmp_path, _DISK_FULL_SCRIPT, "size=1000k", tests, env={"PYTHONPATH": tests})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = output_lines(proc)
    error = lines["ERROR"]
    assert "\n" not in error and str(mount / "checkpoint-2") in error
    assert "the disk is full" in error and "bytes, " in error and "are free in" in error
    needed = int(error.split("needs ")[1].split(" bytes")[0].replace(",", ""))
    free = int(error.split("bytes, ")[1].split(" are free")[0].replace(",", ""))
    assert needed > free >= 0
    # no checkpoint-2.tmp, the earlier checkpoint is there (and the running job's lock on its output folder)
    assert lines["LEFT"] == ".xshard_job.lock,checkpoint-1"
    assert "LOADED" in proc.stdout
