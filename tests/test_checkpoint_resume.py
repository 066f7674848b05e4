"""Resuming never silently starts over: a mistyped or empty folder is an error naming it on every rank;
``missing_ok=True`` is the explicit "resume if present" of a script's first run."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_workers
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
