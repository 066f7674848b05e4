"""Checkpoints never lose work: a rank killed mid-save, save_total_limit, and bad files that must fail
clearly (naming the file and the key) without changing the running job."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
from support.distributed import run_workers
from support.save_crash import die_after_files
from test_checkpoint import _job, _plain, _steps

pytestmark = pytest.mark.multiprocess


def _crash_worker(rank, world_size, out):
    acc, model, opt, loader, sched = _job(world_size, state_dict_type="sharded")
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(os.path.join(out, "checkpoint-2"))
    _steps(acc, model, opt, loader, sched, 1)
    die_after_files(1, rank=1)  # rank 1 dies after its first file
    acc.save_state(os.path.join(out, "checkpoint-3"))
    return "not reached"


def _resume_worker(rank, world_size, out):
    acc, model, opt, loader, sched = _job(world_size, state_dict_type="sharded")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = acc.load_state(out, resume_from_checkpoint=True)
    state = _plain(model)
    step = acc.step
    _steps(acc, model, opt, loader, sched, 1)
    acc.save_state(os.path.join(out, "checkpoint-4"), save_total_limit=1)
    return str(path), step, state, [str(w.message) for w in caught]


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_resume_skips_the_broken_one(tmp_path):
    from xshard.checkpoint.consolidate import consolidated_state_dict

    with pytest.raises(RuntimeError, match="died without a result|failed"):
        run_workers(_crash_worker, 2, str(tmp_path), timeout=120)
    assert (tmp_path / "checkpoint-3.tmp").is_dir() and not (tmp_path / "checkpoint-3").exists()
    saved = consolidated_state_dict(tmp_path / "checkpoint-2")  # the previous checkpoint is whole
    path, step, state, warned = run_workers(_resume_worker, 2, str(tmp_path))[0]
    assert path == str(tmp_path / "checkpoint-2") and step == 2
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert any("skipping incomplete checkpoint" in m and "checkpoint-3.tmp" in m for m in warned)
    # save_total_limit=1: the older complete checkpoint went, the new one stays
    assert (tmp_path / "checkpoint-4" / "xshard_state.json").is_file()
    assert not (tmp_path / "checkpoint-2").exists()


def _corrupt(src, dst, name, how):
    shutil.copytree(src, dst)
    path = os.path.join(dst, name)
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-5] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _bad_files_worker(rank, world_size, root):
    good = os.path.join(root, "good")
    acc, model, opt, loader, sched = _job(world_size, state_dict_type="sharded")
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(good)
    local = acc.save_state(os.path.join(root, "local"), state_dict_type="local")
    other, other_model, *_ = _job(world_size, width=12)  # another model
    other.save_state(os.path.join(root, "other"), state_dict_type="sharded")
    if rank == 0:
        _corrupt(good, os.path.join(root, "truncated"), "model.rank1.safetensors", "truncate")
        _corrupt(good, os.path.join(root, "flipped"), "optimizer.rank0.safetensors", "flip")
    acc.wait_for_everyone()

    before = (_plain(model), {k: {n: v.clone() for n, v in s.items()} for k, s in opt.optimizer.state.items()},
              sched.state_dict(), loader.state_dict(), acc.step)
    errors = {}
    for name in ("truncated", "flipped", "other", "missing"):
        try:
            acc.load_state(os.path.join(root, name))
            errors[name] = None
        except Exception as exc:  # the CheckpointError every rank raises
            errors[name] = f"{type(exc).__name__}: {exc}"
    after = (_plain(model), {k: {n: v.clone() for n, v in s.items()} for k, s in opt.optimizer.state.items()},
             sched.state_dict(), loader.state_dict(), acc.step)
    # a local checkpoint resumed at another stage
    acc2, *_ = _job(world_size, stage=2)
    try:
        acc2.load_state(local)
        errors["stage"] = None
    except Exception as exc:
        errors["stage"] = f"{type(exc).__name__}: {exc}"
    unchanged = (all(torch.equal(before[0][k], after[0][k]) for k in before[0])
                 and all(torch.equal(v, after[1][p][n]) for p, s in before[1].items() for n, v in s.items())
                 and before[2:] == after[2:])
    return errors, unchanged


def test_bad_checkpoints_fail_clearly_on_every_rank_and_change_nothing(tmp_path):
    results = run_workers(_bad_files_worker, 2, str(tmp_path))
    for rank, (errors, unchanged) in enumerate(results):
        assert unchanged, rank
        assert all(e is not None and e.startswith(("CheckpointError", "CheckpointMismatchError"))
                   for e in errors.values()), errors
        assert "key 'stage' is 3 in the checkpoint but 2 in this job" in errors["stage"]
        assert "other" in errors["other"] and "inp.weight" in errors["other"] and "shape (12, 8)" in errors["other"]
        assert "xshard_state.json is missing" in errors["missing"] or "no such checkpoint" in errors["missing"]
    r0, r1 = results[0][0], results[1][0]
    # only rank 1 reads its truncated file; rank 0 learns that a rank failed and raises as well
    assert "model.rank1.safetensors is truncated" in r1["truncated"] and "files['model.rank1.safetensors']" in r1[
        "truncated"]
    assert "other rank(s) could not read this checkpoint" in r0["truncated"]
    assert "optimizer.rank0.safetensors is corrupted" in r0["flipped"] and "xxh3_128 checksum" in r0["flipped"]


def _disk_full_worker(rank, world_size, out):
    import errno

    from xshard.checkpoint import files
    from xshard.checkpoint.files import CheckpointSaveError

    acc, model, opt, loader, sched = _job(world_size, state_dict_type="sharded")
    _steps(acc, model, opt, loader, sched, 1)
    acc.save_state(os.path.join(out, "checkpoint-1"))
    saved = _plain(model)
    _steps(acc, model, opt, loader, sched, 1)
    if rank == 1:  # only this rank's disk fills up: after 2000 bytes of the next save
        budget = [2000]

        class Limited:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                size = len(memoryview(data).cast("B"))
                if size > budget[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                budget[0] -= size
                return self.f.write(data)

            def __getattr__(self, name):
                return getattr(self.f, name)

        files.open = lambda path, mode="r", **kw: Limited(open(path, mode, **kw))
    try:
        acc.save_state(os.path.join(out, "checkpoint-2"))
        error = None
    except CheckpointSaveError as exc:
        error = str(exc)
    files.__dict__.pop("open", None)
    acc.load_state(os.path.join(out, "checkpoint-1"))
    state = _plain(model)
    left = sorted(n for n in os.listdir(out) if n != ".xshard_job.lock")  # the running job's lock stays
    return error, left, all(torch.equal(saved[k], v) for k, v in state.items())


def test_a_disk_full_on_one_rank_stops_every_rank_with_one_line_and_leaves_no_tmp(tmp_path):
    results = run_workers(_disk_full_worker, 2, str(tmp_path), timeout=180)
    for rank, (error, left, reloaded) in enumerate(results):
        assert error is not None and "\n" not in error, rank
        assert error.startswith(f"cannot save the checkpoint {tmp_path / 'checkpoint-2'}: the disk is full (it needs ")
        assert "bytes, " in error and " are free in " in error and "earlier checkpoints are intact" in error
        assert left == ["checkpoint-1"] and reloaded, (rank, left)
    assert results[0][0] == results[1][0]  # the same line on every rank
