"""Chaos: a random rank of a 2-rank training job is SIGKILLed at a random moment (starting, loading,
training, mid-save, mid-rotation), again and again; after every kill the latest complete checkpoint
verifies file by file, the next run resumes from exactly that one, and the run that finally
completes ends bit for bit equal to an uninterrupted one. The output folder also holds the user's
files (a log, notes), which every kill leaves as they were.

Each trial's first kill is aimed, for certain: the victim stops at an event of its own (``XSHARD_CHAOS_HOLD``,
see chaos_worker.py) and is killed there. Every other trial's first kill lands in save_total_limit's
rotation (rank 0, as it starts or before it deletes an old checkpoint), the others' in a save (a rank about
to write one of its files into the save's ``.tmp`` folder). A quarter of the other kills aim at a rotation
too, within a few milliseconds of its start or of a deletion. Every kill records where it landed (the
victim's last event, whether a save's ``.tmp`` folder was under way, whether a rotation had begun and not
ended), and the test asserts that its kills landed mid-save and mid-rotation, not only around them.

``make test`` runs a few trials; ``XSHARD_CHAOS_TRIALS=200`` runs more (``XSHARD_CHAOS_SEED`` picks
the random plan, ``XSHARD_CHAOS_REPORT=path.json`` writes the outcome of every trial).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from support.distributed import free_port

from xshard.checkpoint.files import MANIFEST, latest_checkpoint, read_manifest, verify_file

pytestmark = pytest.mark.multiprocess

TRIALS = int(os.environ.get("XSHARD_CHAOS_TRIALS", "2"))
SEED = int(os.environ.get("XSHARD_CHAOS_SEED", "1311"))
KILLS_PER_TRIAL = 3  # at most this many killed runs before the run that must complete
WORKER = Path(__file__).resolve().parent / "support" / "chaos_worker.py"
ROOT = Path(__file__).resolve().parent.parent
TOTAL_STEPS, SAVE_EVERY = 12, 3


class Job:
    """The two ranks of one run of chaos_worker.py, with their events as they happen."""

    def __init__(self, out: Path, logs: Path, hold: tuple[int, str] | None = None) -> None:
        """``hold``: (rank, "<name> <step>"), the event at which that rank stops to be killed."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        self.events: list[tuple[int, str, int]] = []
        self.cond = threading.Condition()
        self.procs = []
        self.readers = []
        logs.mkdir(parents=True, exist_ok=True)
        for rank in range(2):
            err = open(logs / f"rank{rank}.txt", "w")
            held = {"XSHARD_CHAOS_HOLD": hold[1]} if hold is not None and hold[0] == rank else {}
            proc = subprocess.Popen([sys.executable, str(WORKER), str(out)], stdout=subprocess.PIPE, stderr=err,
                                    text=True, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), **held})
            err.close()
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(rank, proc), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "EVENT":
                with self.cond:
                    self.events.append((rank, parts[1], int(parts[2])))
                    self.cond.notify_all()

    def wait_for(self, rank: int, name: str, step: int, timeout: float) -> bool:
        """Block until ``rank`` reports ``name step`` (False if it never does)."""
        with self.cond:
            return self.cond.wait_for(lambda: (rank, name, step) in self.events
                                      or self.procs[rank].poll() is not None, timeout) and (
                (rank, name, step) in self.events)

    def last_event(self, rank: int) -> str | None:
        """The last event ``rank`` reported, once its output is read to the end (after it was killed)."""
        self.readers[rank].join(timeout=10)
        with self.cond:
            mine = [f"{n} {s}" for r, n, s in self.events if r == rank]
        return mine[-1] if mine else None

    def kill(self, rank: int) -> bool:
        """SIGKILL ``rank``; False when it had already exited."""
        if self.procs[rank].poll() is not None:
            return False
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].wait()
        return True

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes once both ranks ended (None: still running at the deadline)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        for rank in range(2):
            self.kill(rank)


def _checkpoint_step(out: Path) -> int:
    """Step of the newest complete checkpoint under ``out`` (0: none), after verifying every file it lists."""
    with warnings.catch_warnings():  # a killed save's .tmp folder is skipped, as it must be: that is no news here
        warnings.filterwarnings("ignore", message="skipping incomplete checkpoint")
        latest = latest_checkpoint(out)
    if latest is None:
        return 0
    manifest = read_manifest(latest)
    for name in manifest["files"]:
        verify_file(latest, name, manifest)  # size and sha256 of every file: complete means whole
    return int(manifest["step"])


def _events_ahead(step: int) -> list[tuple[str, int]]:
    """The events a run resuming at ``step`` goes through."""
    ahead = [("load_begin", 0), ("loaded", step)]
    for s in range(step + 1, TOTAL_STEPS + 1):
        ahead.append(("step", s))
        if s % SAVE_EVERY == 0:
            ahead += [("save_begin", s), ("saved", s)]
    return ahead


def _tmp_folders(out: Path) -> set[tuple[str, int]]:
    """The save folders under way (or left by a killed save) under ``out``, with their inodes."""
    found = set()
    for p in out.iterdir():
        try:
            if p.name.endswith(".tmp"):
                found.add((p.name, p.stat().st_ino))
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return found


_USER_FILES = {"train.log": "step 3 loss 0.41\n", "notes/run.md": "lr 1e-2, kept by hand\n"}


def _add_user_files(out: Path) -> None:
    for name, text in _USER_FILES.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


def _user_files_intact(out: Path) -> bool:
    return all((out / name).is_file() and (out / name).read_text() == text for name, text in _USER_FILES.items())


def _killed_run(out: Path, logs: Path, rng: random.Random, aim: str | None = None) -> dict:
    """One run with one rank SIGKILLed at a random moment, or (``aim``: "rotation" or "save") stopped and
    killed in that phase for certain; returns what happened and where the kill landed."""
    resume_step = _checkpoint_step(out)
    victim = rng.randrange(2)
    leftovers = _tmp_folders(out)
    ahead = _events_ahead(resume_step)
    family = rng.random()
    rotations = [("rotate_begin", s) for n, s in ahead if n == "save_begin"]
    saves = [e for e in ahead if e[0] == "save_begin"]
    hold = None
    if aim == "rotation" and rotations:  # rank 0 stopped as a rotation starts or before it deletes a folder
        victim = 0
        name, step = rng.choice(rotations)
        if rng.random() < 0.5 and step >= 3 * SAVE_EVERY:  # from the third save on, a rotation deletes one
            name = "remove"
        hold = (victim, f"{name} {step}")
    elif aim == "save" and saves:  # a rank stopped as it writes its first file into the save's .tmp folder
        name, step = "write", rng.choice(saves)[1]
        hold = (victim, f"{name} {step}")
    job = Job(out, logs, hold)
    if hold is not None:
        job.wait_for(victim, name, step, timeout=120)
    elif family < 0.2:  # a moment anywhere, start-up included
        name, step = "after_start", 0
        time.sleep(rng.uniform(0.0, 4.0))
    elif family > 0.75 and rotations:  # rank 0 within milliseconds of starting a rotation or a deletion in it
        victim = 0
        name, step = rng.choice(rotations)
        if rng.random() < 0.5 and step >= 3 * SAVE_EVERY:
            name = "remove"
        job.wait_for(0, name, step, timeout=120)
        time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.002), rng.uniform(0.0, 0.01)]))
    else:  # an event of either rank (40%: the start of a save), then a random part of what follows it
        name, step = rng.choice(saves) if family < 0.6 and saves else rng.choice(ahead)
        job.wait_for(rng.randrange(2), name, step, timeout=120)
        time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.005), rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.2)]))
    mid_save = bool(_tmp_folders(out) - leftovers)  # a save of this run was under way
    killed = job.kill(victim)
    last = job.last_event(victim)
    with job.cond:
        begun = {s for r, n, s in job.events if r == 0 and n == "rotate_begin"}
        ended = {s for r, n, s in job.events if r == 0 and n == "rotated"}
    codes = job.wait(timeout=15)  # the survivor fails on its own once it meets its peer in a collective
    survivor = 1 - victim
    outcome = {"resume_step": resume_step, "victim": victim, "at": f"{name} {step}", "aimed": hold is not None,
               "killed": killed, "victim_last_event": last, "mid_save": killed and mid_save,
               "mid_rotation": killed and victim == 0 and bool(begun - ended),
               "survivor_exit": codes[survivor], "survivor_exited_by_itself": codes[survivor] is not None}
    job.stop()
    outcome["checkpoint_step_after"] = _checkpoint_step(out)
    outcome["tmp_left"] = sorted(p.name for p in out.iterdir() if p.name.endswith((".tmp", ".deleted")))
    outcome["user_files_intact"] = _user_files_intact(out)
    return outcome


def _clean_run(out: Path, logs: Path) -> tuple[int, list[int | None]]:
    """A run without kills: the step it resumed from and the exit codes."""
    job = Job(out, logs)
    codes = job.wait(timeout=240)
    job.stop()
    loaded = [s for r, n, s in job.events if n == "loaded" and r == 0]
    return (loaded[0] if loaded else -1), codes


@pytest.mark.timeout(240 + 240 * TRIALS)  # a run of the job takes seconds; a loaded machine may take minutes
def test_kills_at_random_moments_never_cost_the_run(tmp_path):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    loaded, codes = _clean_run(reference_dir, tmp_path / "logs" / "reference")
    assert codes == [0, 0] and loaded == 0, (tmp_path / "logs" / "reference" / "rank0.txt").read_text()[-3000:]
    reference = torch.load(reference_dir / "final.pt", weights_only=True)

    rng = random.Random(SEED)
    trials = []
    for trial in range(TRIALS):
        out = tmp_path / f"trial{trial}"
        out.mkdir()
        _add_user_files(out)
        kills = []
        for run in range(rng.randint(1, KILLS_PER_TRIAL)):
            # each trial's first kill is aimed: into a rotation (even trials) or a save (odd ones)
            aim = ("rotation" if trial % 2 == 0 else "save") if run == 0 else None
            kills.append(_killed_run(out, tmp_path / "logs" / f"trial{trial}.run{run}", rng, aim))
            if (out / "final.pt").exists():  # the kill came after the end: nothing left to resume
                break
        expected = _checkpoint_step(out)
        final_logs = tmp_path / "logs" / f"trial{trial}.final"
        loaded, codes = _clean_run(out, final_logs)
        assert codes == [0, 0], (trial, kills, (final_logs / "rank0.txt").read_text()[-3000:])
        assert loaded == expected, (trial, kills)  # resumed from exactly the latest complete checkpoint
        final = torch.load(out / "final.pt", weights_only=True)
        assert final.keys() == reference.keys()
        assert all(torch.equal(final[k], v) for k, v in reference.items()), (trial, kills)  # bit for bit
        assert all(k["user_files_intact"] for k in kills) and _user_files_intact(out), (trial, kills)
        trials.append({"trial": trial, "kills": kills, "resumed_from": loaded})

    where = collections.Counter(k["at"].split()[0] for t in trials for k in t["kills"])
    summary = {"trials": TRIALS, "seed": SEED, "kills": sum(len(t["kills"]) for t in trials),
               "kill_points": dict(where),
               "killed_mid_save": sum(k["mid_save"] for t in trials for k in t["kills"]),
               "killed_mid_rotation": sum(k["mid_rotation"] for t in trials for k in t["kills"]),
               "survivor_exited_by_itself": sum(k["survivor_exited_by_itself"] for t in trials for k in t["kills"]),
               "runs_all_equal_reference": True}
    print(json.dumps(summary))
    report = os.environ.get("XSHARD_CHAOS_REPORT")
    if report:
        Path(report).write_text(json.dumps({"summary": summary, "trials": trials}, indent=1))
    assert not any(MANIFEST in os.listdir(tmp_path / f"trial{t}") for t in range(TRIALS))  # sanity: a folder of
    # checkpoints is never itself a checkpoint
    kills = [k for t in trials for k in t["kills"]]
    for kill in kills:  # an aimed kill landed where it aimed, the victim stopped at the event it was told
        if kill["aimed"]:
            assert kill["killed"] and kill["victim_last_event"] == kill["at"], kill
            assert kill["mid_rotation"] if kill["at"].startswith(("rotate_begin", "remove")) else kill["mid_save"], kill
    assert summary["killed_mid_rotation"] >= 1, summary
    assert summary["killed_mid_save"] >= 1 or TRIALS < 2, summary  # the first save-aimed kill is trial 1's
