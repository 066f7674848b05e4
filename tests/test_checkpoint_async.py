"""Async save: the same files as a blocking save, the previous checkpoint survives a kill during the
background write, and a failed background write is raised at the next call on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.distributed import run_workers
from support.save_crash import EXIT_CODE
from test_checkpoint import _job, _plain, _steps

from xshard.checkpoint import CheckpointError, latest_checkpoint

pytestmark = pytest.mark.multiprocess


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _same_bytes_worker(rank, world_size, folder):
    folder = Path(folder)
    found = {}
    for kind in ("full", "sharded", "local"):
        acc, model, opt, loader, sched = _job(world_size, state_dict_type=kind)
        _steps(acc, model, opt, loader, sched, 3)
        at_save = _plain(model)
        acc.save_state(folder / kind / "blocking")
        acc.save_state(folder / kind / "async", async_save=True)
        _steps(acc, model, opt, loader, sched, 3)  # training changes every tensor while the files are written
        after = _plain(model)
        moved = any(not torch.equal(v, after[k]) for k, v in at_save.items())
        acc.load_state(folder / kind / "async")  # waits for the background write, then loads it
        loaded_state = _plain(model)
        loaded = all(torch.equal(v, loaded_state[k]) for k, v in at_save.items())
        found[kind] = (moved, loaded, acc.step)
    return found


def test_an_async_save_writes_the_same_bytes_as_a_blocking_save(tmp_path):
    found = run_workers(_same_bytes_worker, 2, str(tmp_path))
    # the weights changed during the background write, and the checkpoint loads back the saved ones
    # (whole weights are complete on rank 0)
    assert [found[0][kind] for kind in found[0]] == [(True, True, 3)] * 3
    assert [found[1][kind][2] for kind in found[1]] == [3] * 3
    for kind in ("full", "sharded", "local"):
        blocking, background = _files(tmp_path / kind / "blocking"), _files(tmp_path / kind / "async")
        assert sorted(background) == sorted(blocking)
        assert [n for n in blocking if blocking[n] != background[n]] == [], kind
    assert not list(tmp_path.glob("*/*.tmp"))


def _host_memory_worker(rank, world_size, folder):
    host = {}
    for stage in (0, 2, 3):  # one job per stage, each ended before the next
        acc, model, opt, loader, sched = _job(world_size, stage=stage, width=256, state_dict_type="sharded")
        _steps(acc, model, opt, loader, sched, 2)
        acc.save_state(Path(folder) / str(stage), async_save=True)
        acc.end()
        host[stage] = acc.job.async_saver.staging.bytes_allocated
    return host


def test_an_async_save_holds_one_copy_of_what_it_writes(tmp_path):
    """The host buffers of an async save hold what the ranks write, once: at stages 0-2 every rank holds
    whole parameters, and a "sharded" checkpoint writes only its rows of them."""
    host = run_workers(_host_memory_worker, 2, str(tmp_path))
    for stage in (0, 2, 3):
        written = sum(p.stat().st_size for p in (tmp_path / str(stage)).iterdir())
        buffers = sum(rank[stage] for rank in host)
        assert 0.9 * written <= buffers <= written, (stage, buffers, written)  # the json files are not staged


def _failing_write_worker(rank, world_size, folder):
    import errno

    from xshard.checkpoint import direct_io

    folder = Path(folder)
    acc, model, opt, loader, sched = _job(world_size)
    _steps(acc, model, opt, loader, sched, 2)
    acc.save_state(folder / "checkpoint-2")
    _steps(acc, model, opt, loader, sched, 2)
    if rank == 1:  # this rank's disk fills up during the background write
        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        direct_io.BlockWriter.write = full_disk  # every file's bytes go through it
    acc.save_state(folder / "checkpoint-4", async_save=True)
    _steps(acc, model, opt, loader, sched, 1)  # training goes on; the error waits for the next call
    try:
        acc.save_state(folder / "checkpoint-5")
    except CheckpointError as exc:
        message = str(exc)
    else:
        message = None
    acc.end()
    return message


def test_an_error_in_the_background_write_is_raised_at_the_next_call_on_every_rank(tmp_path):
    messages = run_workers(_failing_write_worker, 2, str(tmp_path))
    assert "the background write of" in messages[1] and "No space left on device" in messages[1]
    assert "because rank 1 failed to write" in messages[0] and "checkpoint-4" in messages[0]
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"  # nothing half-written counts
    assert not (tmp_path / "checkpoint-5").exists()  # the failing call saved nothing


KILLED = r'''
import os, sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from test_checkpoint import _job, _steps
from support.save_crash import die_after_files
folder = Path(sys.argv[1])
acc, model, opt, loader, sched = _job(1)
_steps(acc, model, opt, loader, sched, 2)
acc.save_state(folder / "checkpoint-2")
_steps(acc, model, opt, loader, sched, 2)
die_after_files(2)  # the process dies after the background thread wrote two files
acc.save_state(folder / "checkpoint-4", async_save=True)
print("save_state returned", flush=True)
_steps(acc, model, opt, loader, sched, 50)
acc.end()
'''


def _resume_worker(rank, world_size, folder):
    acc, model, opt, loader, sched = _job(world_size)
    path = acc.load_state(folder, resume_from_checkpoint=True)
    return path.name, acc.step, _plain(model)


def _reference_worker(rank, world_size):
    acc, model, opt, loader, sched = _job(world_size)
    _steps(acc, model, opt, loader, sched, 2)
    return _plain(model)


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, clean_env):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "XSHARD_BACKEND": "cpu"}
    done = subprocess.run([sys.executable, str(script), str(out), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == EXIT_CODE, done.stderr[-3000:]  # die_after_files' exit, inside the background write
    assert "save_state returned" in done.stdout
    assert (out / "checkpoint-4.tmp").is_dir() and not (out / "checkpoint-4").exists()
    (name, step, weights), = run_workers(_resume_worker, 1, str(out))
    (expected,) = run_workers(_reference_worker, 1)
    assert (name, step) == ("checkpoint-2", 2)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
