"""The output folder is the job's: rotation never follows a symbolic link out of it, and a second job saving
into the same folder is refused at its first save (one process, unless a test says otherwise).

- A link in the rotated series (``checkpoint-1`` pointing at a checkpoint kept elsewhere) is the user's:
  ``save_state(..., save_total_limit=N)``, Accelerate's automatic naming with ``total_limit`` and the Trainer's
  ``save_total_limit`` never delete through it, rename it or count it; the target stays byte for byte.
- Two jobs: a save into a folder whose lock names a running job on this host is refused with one line
  naming the folder, the other job and the fix; a lock whose process is gone is taken over with a warning;
  a real second process saving into the folder of a running job is refused; on 2 ranks every rank raises
  the same line (multiprocess mark).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from support.distributed import run_workers
from test_checkpoint import _job, _steps

from xshard.checkpoint import files as ckpt_files
from xshard.checkpoint.files import CheckpointSaveError

ROOT = Path(__file__).resolve().parent.parent
#: the file a user removes when the message says so (the job that held the folder is gone)
LOCK = ".xshard_job.lock"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _checkpoint_elsewhere(acc, tmp_path: Path, extra: bool) -> tuple[Path, dict[str, bytes]]:
    """A complete checkpoint outside the output folder (the user's, e.g. a pretrained run's), optionally with
    a note of the user's inside it; returns it and its bytes."""
    kept = acc.save_state(tmp_path / "kept" / "checkpoint-1")
    if extra:
        (kept / "notes.txt").write_text("the run I compare against\n")
    return kept, _snapshot(kept)


@pytest.fixture
def job():
    return _job(1, state_dict_type="full")


@pytest.mark.parametrize("extra", [False, True], ids=["only-checkpoint-files", "with-a-file-of-the-users"])
def test_rotation_never_follows_a_link_in_the_series(job, tmp_path, extra):
    acc, model, opt, loader, sched = job
    _steps(acc, model, opt, loader, sched, 1)
    kept, before = _checkpoint_elsewhere(acc, tmp_path, extra)
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-1").symlink_to(kept, target_is_directory=True)
    for step in (2, 3, 4):
        _steps(acc, model, opt, loader, sched, 1)
        acc.save_state(out / f"checkpoint-{step}", save_total_limit=2)
    assert _snapshot(kept) == before  # the target, byte for byte
    assert (out / "checkpoint-1").is_symlink() and (out / "checkpoint-1").resolve() == kept.resolve()
    # the link is not one of the job's: its own 2 newest are kept
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]


def test_automatic_naming_rotation_never_follows_a_link(tmp_path):
    import xshard
    from xshard.accelerate_compat.project import ProjectConfiguration

    project = tmp_path / "project"
    acc = xshard.Accelerator(config={"stage": 3}, seed=0, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2))
    net = torch.nn.Linear(4, 2)
    acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    kept, before = _checkpoint_elsewhere(acc, tmp_path, extra=False)
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "checkpoint_0").symlink_to(kept, target_is_directory=True)
    acc.project_configuration.iteration = 1
    for _ in range(3):
        acc.save_state()
    assert _snapshot(kept) == before
    assert (project / "checkpoints" / "checkpoint_0").is_symlink()
    assert sorted(p.name for p in (project / "checkpoints").iterdir() if p.is_dir()) == [
        "checkpoint_0", "checkpoint_2", "checkpoint_3"]


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.linear(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_trainer_rotation_never_counts_a_link(tmp_path):
    """The Trainer's checkpoint-N rotation: a link named like a later checkpoint (its target newer than the
    run's checkpoints) must not push out the checkpoint just saved."""
    from xshard.trainer import Trainer, TrainingArguments

    kept = tmp_path / "kept" / "checkpoint-999"
    kept.mkdir(parents=True)
    (kept / "trainer_state.json").write_text('{"global_step": 999}')
    (kept / "notes.txt").write_text("a run of mine\n")
    future = time.time() + 3600
    os.utime(kept, (future, future))
    before = _snapshot(kept)
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-999").symlink_to(kept, target_is_directory=True)
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(8)]
    args = TrainingArguments(output_dir=str(out), use_cpu=True, per_device_train_batch_size=2, max_steps=3,
                             save_strategy="steps", save_steps=1, save_total_limit=1, report_to="none",
                             disable_tqdm=True, logging_steps=1, seed=0)
    Trainer(model=_Regression(), args=args, train_dataset=data).train()
    assert _snapshot(kept) == before
    assert (out / "checkpoint-999").is_symlink()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-3", "checkpoint-999"]
    assert (out / "checkpoint-3" / ckpt_files.MANIFEST).is_file()
    saved_args = torch.load(out / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert saved_args.save_total_limit == 1  # the arguments as the user gave them


def _lock(folder: Path, pid: int, host: str | None = None, process_start: int | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    owner = {"host": host or socket.gethostname(), "pid": pid, "started": time.time(), "run_id": "another-job"}
    if process_start is not None:
        owner["process_start"] = process_start
    (folder / LOCK).write_text(json.dumps(owner))


def test_a_folder_held_by_a_running_job_is_refused_at_the_first_save(job, tmp_path):
    acc = job[0]
    out = tmp_path / "out"
    other = os.getppid()  # a process that runs as long as this test does
    _lock(out, other)
    with pytest.raises(CheckpointSaveError) as refused:
        acc.save_state(out / "checkpoint-1", save_total_limit=2)
    message = str(refused.value)
    assert "\n" not in message
    assert str(out) in message and f"pid {other}" in message and socket.gethostname() in message
    assert "another output folder" in message and "remove that file if that job is gone" in message
    assert sorted(p.name for p in out.iterdir()) == [LOCK]  # nothing written


def test_a_lock_whose_process_is_gone_is_taken_over_with_a_warning(job, tmp_path):
    acc = job[0]
    out = tmp_path / "out"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _lock(out, gone.pid)
    with pytest.warns(UserWarning, match=f"pid {gone.pid}.* no longer running"):
        acc.save_state(out / "checkpoint-1", save_total_limit=2)
    assert ckpt_files.is_complete(out / "checkpoint-1")
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    acc.end()  # the end of the job frees the folder
    assert not (out / LOCK).exists()


def test_a_lock_whose_pid_was_reused_by_another_process_is_taken_over_and_a_live_owner_still_holds(job, tmp_path):
    """The lock names its owner's pid and start time: the same pid running a process that started at another
    time (the pid reused by an unrelated process) no longer holds the folder."""
    from xshard.checkpoint.output_lock import process_start

    acc = job[0]
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "out"
        _lock(out, unrelated.pid, process_start=process_start(unrelated.pid) - 1)  # an owner that started before
        with pytest.warns(UserWarning, match=f"pid {unrelated.pid} now belongs to another process"):
            acc.save_state(out / "checkpoint-1", save_total_limit=2)
        assert ckpt_files.is_complete(out / "checkpoint-1")
        assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()

        held = tmp_path / "held"
        _lock(held, unrelated.pid, process_start=process_start(unrelated.pid))  # that very process: it holds
        with pytest.raises(CheckpointSaveError, match=f"pid {unrelated.pid}"):
            acc.save_state(held / "checkpoint-1", save_total_limit=2)
    finally:
        unrelated.kill()
        unrelated.wait()


def _held_folder_worker(rank, world_size, out, owner):
    acc = _job(world_size, state_dict_type="sharded")[0]
    try:
        acc.save_state(Path(out) / "checkpoint-1", save_total_limit=2)
    except CheckpointSaveError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
def test_every_rank_refuses_a_held_folder_with_the_same_line(tmp_path):
    out = tmp_path / "out"
    other = os.getppid()
    _lock(out, other)
    errors = run_workers(_held_folder_worker, 2, str(out), other, timeout=120)
    assert errors[0] is not None and errors[0] == errors[1], errors  # the main process's one line, on each rank
    assert f"pid {other}" in errors[0] and "\n" not in errors[0]
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


_OTHER_JOB = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch, xshard
    out, go = Path(sys.argv[1]), Path(sys.argv[2])
    acc = xshard.Accelerator(config={"stage": 0}, seed=0)
    model = acc.prepare(torch.nn.Linear(4, 2))
    acc.save_state(out / "checkpoint-1", save_total_limit=2)
    print("saved", flush=True)
    deadline = time.time() + 120
    while not go.exists() and time.time() < deadline:
        time.sleep(0.05)
    acc.save_state(out / "checkpoint-2", save_total_limit=2)
    acc.end()
""")


def test_a_second_job_saving_into_the_same_folder_is_refused(job, tmp_path):
    acc = job[0]
    out, go = tmp_path / "out", tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    other = subprocess.Popen([sys.executable, "-c", _OTHER_JOB, str(out), str(go)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "saved", other.stderr.read() if other.stderr else ""
        with pytest.raises(CheckpointSaveError, match=f"pid {other.pid}\\b"):
            acc.save_state(out / "checkpoint-5", save_total_limit=2)
        assert not (out / "checkpoint-5").exists()
    finally:
        go.touch()
        _, err = other.communicate(timeout=120)
    assert other.returncode == 0, err[-3000:]
    # the first job kept its checkpoints and, at its end, freed the folder for the next job
    assert ckpt_files.is_complete(out / "checkpoint-1") and ckpt_files.is_complete(out / "checkpoint-2")
    assert not (out / LOCK).exists()
    acc.save_state(out / "checkpoint-5", save_total_limit=2)
    assert ckpt_files.is_complete(out / "checkpoint-5")


def test_rotation_names_a_checkpoint_that_vanished_under_it(job, tmp_path, monkeypatch):
    acc, model, opt, loader, sched = job
    out = tmp_path / "out"
    acc.save_state(out / "checkpoint-1", save_total_limit=1)
    real = ckpt_files.complete_checkpoints

    def vanishing(folder, warn=False):  # another job deletes checkpoint-1 right after the rotation listed it
        found = real(folder, warn)
        ckpt_files.shutil.rmtree(out / "checkpoint-1", ignore_errors=True)
        return found

    monkeypatch.setattr(ckpt_files, "complete_checkpoints", vanishing)
    with pytest.warns(UserWarning, match="checkpoint-1 vanished while save_total_limit deleted it"):
        acc.save_state(out / "checkpoint-2", save_total_limit=1)
    assert ckpt_files.is_complete(out / "checkpoint-2")
