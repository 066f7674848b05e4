"""A launcher never leaves ranks behind: killed with SIGKILL its ranks die with it; SIGINT and SIGTERM
reach the ranks and the launcher exits with 128 + the signal's number (or the rank's own code)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch_signals import SLEEPER, gone_within, kill_all, wait_for_pids

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ROOT / "backends" / "launchers"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XSHARD_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(XSHARD_BACKEND="cpu", OMP_NUM_THREADS="1")
    return env


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _xshard_launch(tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    return _start([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(script), str(tmp_path)])


def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path) -> None:
    launcher = _xshard_launch(tmp_path)
    pids: list[int] = []
    try:
        pids = wait_for_pids(tmp_path, 2, launcher)
        launcher.kill()
        launcher.communicate(timeout=30)
        assert gone_within(pids, 5), f"ranks {pids} outlived their launcher"
    finally:
        launcher.kill()
        kill_all(pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_stop_the_ranks_and_set_the_exit_code(tmp_path, sig) -> None:
    launcher = _xshard_launch(tmp_path)
    pids: list[int] = []
    try:
        pids = wait_for_pids(tmp_path, 2, launcher)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + sig
        assert f"xshard launch: got {sig.name}; the ranks were stopped" in err
        assert "SignalException" not in err and "xshard/cli" not in err  # no traceback of the launcher's own
        assert gone_within(pids, 5)
    finally:
        launcher.kill()
        kill_all(pids)


# ------------------------------------------------------------------ one child (the single and xla launchers)

HANDLES_SIGTERM = r'''
import os, signal, sys, time
def stop(signum, frame):
    sys.exit(5)  # e.g. after saving a checkpoint
signal.signal(signal.SIGTERM, stop)
path = os.path.join(sys.argv[1], "pid0")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(300)
'''

RUN_CHILD = "import sys; from xshard.backends.launchers import run_child; sys.exit(run_child(sys.argv[1:]))"


@pytest.mark.parametrize("case", ["sigkill", "sigterm", "rank_handles_sigterm"])
def test_one_child_is_tied_to_its_launcher(tmp_path, case) -> None:
    body = HANDLES_SIGTERM if case == "rank_handles_sigterm" else SLEEPER
    launcher = _start([sys.executable, "-c", RUN_CHILD, sys.executable, "-c", body, str(tmp_path)])
    pids: list[int] = []
    try:
        pids = wait_for_pids(tmp_path, 1, launcher)
        assert pids[0] != launcher.pid
        if case == "sigkill":
            launcher.kill()
        else:
            launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
        expected = {"sigkill": -9, "sigterm": 143, "rank_handles_sigterm": 5}[case]
        assert launcher.returncode == expected, err
        if case != "sigkill":
            assert f"got SIGTERM; the job stopped with exit code {expected}" in err
        assert gone_within(pids, 5)
    finally:
        launcher.kill()
        kill_all(pids)


# The portable way (no parent-death signal, as on macOS): a supervising guard polls its parent.
SUPERVISED = (
    "import sys; sys.path.insert(0, sys.argv[1]); from parent_death import supervise; "
    "import os; sys.exit(supervise(os.getppid(), sys.argv[2:], poll_seconds=0.2))"
)
PARENT = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(300)"


def test_without_a_parent_death_signal_the_guard_stops_the_rank_when_the_launcher_is_gone(tmp_path) -> None:
    launcher = _start([sys.executable, "-c", PARENT, sys.executable, "-c", SUPERVISED, str(LAUNCHERS),
                       sys.executable, "-c", SLEEPER, str(tmp_path)])
    pids: list[int] = []
    try:
        pids = wait_for_pids(tmp_path, 1, launcher)
        launcher.kill()
        launcher.communicate(timeout=30)
        assert gone_within(pids, 5), "the supervised rank outlived its launcher"
    finally:
        launcher.kill()
        kill_all(pids)
