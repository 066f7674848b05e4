"""Resuming never silently starts over: a mistyped or empty folder is an error naming it on every rank;
``missing_ok=True`` is the explicit "resume if present" of a script's first run."""

from __future__ import annotations

import os

import pytest
import torch
from support.distributed import run_workers
from test_checkpoint import _job, _plain, _steps

pytestmark = pytest.mark.multiprocess


def _attempt(acc, *args, **kwargs):
    try:
        path = acc.load_state(*args, **kwargs)
        return "loaded", None if path is None else str(path)
    except Exception as exc:
        return "error", f"{type(exc).__name__}: {exc}"


def _worker(rank, world_size, root):
    out = os.path.join(root, "checkpoints")
    acc, model, opt, loader, sched = _job(world_size)
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(os.path.join(out, "checkpoint-2"))
    if rank == 0:
        os.makedirs(os.path.join(root, "empty"))
        os.makedirs(os.path.join(root, "crashed", "checkpoint-7.tmp"))
    acc.wait_for_everyone()

    fresh, model, *_ = _job(world_size)
    before = _plain(model)
    results = {
        "mistyped": _attempt(fresh, os.path.join(root, "chekpoints"), resume_from_checkpoint=True),
        "empty": _attempt(fresh, os.path.join(root, "empty"), resume_from_checkpoint=True),
        "crashed": _attempt(fresh, os.path.join(root, "crashed"), resume_from_checkpoint=True),
        "direct_missing": _attempt(fresh, os.path.join(out, "checkpoint-3")),
        "parent_not_checkpoint": _attempt(fresh, out),
        "missing_ok": _attempt(fresh, os.path.join(root, "chekpoints"), resume_from_checkpoint=True,
                               missing_ok=True),
        "missing_ok_direct": _attempt(fresh, os.path.join(out, "checkpoint-3"), missing_ok=True),
        "missing_ok_empty": _attempt(fresh, os.path.join(root, "crashed"), resume_from_checkpoint=True,
                                     missing_ok=True),
    }
    unchanged = all(torch.equal(before[k], v) for k, v in _plain(model).items()) and fresh.step == 0
    results["present"] = _attempt(fresh, out, resume_from_checkpoint=True, missing_ok=True)
    results["a_checkpoint_itself"] = _attempt(fresh, os.path.join(out, "checkpoint-2"), resume_from_checkpoint=True)
    return results, unchanged, fresh.step


def test_a_missing_or_empty_folder_is_an_error_naming_it_unless_missing_ok(tmp_path):
    root = str(tmp_path)
    for rank, (results, unchanged, step) in enumerate(run_workers(_worker, 2, root)):
        assert unchanged, rank  # nothing was loaded by the failed or skipped attempts
        kind, message = results["mistyped"]
        assert kind == "error" and message.startswith("CheckpointError"), message
        assert os.path.join(root, "chekpoints") in message
        assert f"did you mean {os.path.join(root, 'checkpoints')!r}" in message and "missing_ok=True" in message
        kind, message = results["empty"]
        assert kind == "error" and f"{os.path.join(root, 'empty')} holds no complete checkpoint" in message
        kind, message = results["crashed"]
        assert kind == "error" and "incomplete, skipped: checkpoint-7.tmp" in message
        kind, message = results["direct_missing"]
        assert kind == "error" and "checkpoint-3: no such checkpoint folder" in message
        kind, message = results["parent_not_checkpoint"]
        assert kind == "error" and "holds checkpoints but is not one" in message and "checkpoint-2" in message
        assert results["missing_ok"] == ("loaded", None)
        assert results["missing_ok_direct"] == ("loaded", None)
        assert results["missing_ok_empty"] == ("loaded", None)
        assert results["present"] == ("loaded", os.path.join(root, "checkpoints", "checkpoint-2"))
        assert results["a_checkpoint_itself"] == ("loaded", os.path.join(root, "checkpoints", "checkpoint-2"))
        assert step == 2


def _fallback_worker(rank, world_size, root):
    import logging

    out = os.path.join(root, "out")
    acc, model, opt, loader, sched = _job(world_size)
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(os.path.join(out, "checkpoint-2"))
    older = _plain(model)
    _steps(acc, model, opt, loader, sched, 1)
    acc.save_state(os.path.join(out, "checkpoint-3"))
    if rank == 0:  # bit rot in the newest checkpoint's weights
        path = os.path.join(out, "checkpoint-3", "model.safetensors")
        data = bytearray(open(path, "rb").read())
        data[-3] ^= 0xFF
        open(path, "wb").write(bytes(data))
    acc.wait_for_everyone()

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("xshard.checkpoint").addHandler(handler)
    fresh, model, *_ = _job(world_size)
    loaded = str(fresh.load_state(out, resume_from_checkpoint=True))
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    other, *_ = _job(world_size, width=12)  # another model: an error, never a fallback
    mismatch = _attempt(other, out, resume_from_checkpoint=True)
    return loaded, fresh.step, _plain(model), older, warned, mismatch


def test_a_damaged_newest_checkpoint_falls_back_loudly_to_the_previous_one(tmp_path):
    for rank, (loaded, step, state, older, warned, mismatch) in enumerate(
            run_workers(_fallback_worker, 2, str(tmp_path))):
        assert loaded == str(tmp_path / "out" / "checkpoint-2") and step == 2
        if rank == 0:
            assert all(torch.equal(state[k], v) for k, v in older.items())
        assert any("checkpoint-3" in m and "falling back to the previous checkpoint" in m and
                   ("model.safetensors is corrupted" in m or "other rank(s)" in m) for m in warned), warned
        kind, message = mismatch
        assert kind == "error" and message.startswith("CheckpointMismatchError"), message
