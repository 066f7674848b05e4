"""`xshard launch` leaves nothing in the temporary folder: not on a normal exit (no ``torchelastic_*``
folder of torchrun's), not when stopped with SIGTERM or SIGINT, and what a launcher killed with SIGKILL
left is removed by the next launch on the host, which touches no folder of a launcher still running
and nothing that is not a launcher's. ``TMPDIR`` points at a folder of the test's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from xshard.backends.launchers.temp_dirs import _host

pytestmark = pytest.mark.multiprocess

SLEEPER = "import time, xshard\nxshard.Accelerator()\nprint('up', flush=True)\ntime.sleep(120)\n"


def _env(temp) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("XSHARD_")}
    return {**base, "XSHARD_BACKEND": "cpu", "TMPDIR": str(temp)}


def _started(tmp_path, temp):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "xshard", "launch", "--nproc", "1", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(temp))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_a_job_that_ends_leaves_nothing_in_the_temporary_folder(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = tmp_path / "train.py"
    script.write_text("import xshard\nxshard.Accelerator()\nprint('done')\n")
    done = subprocess.run([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(script)],
                          capture_output=True, text=True, env=_env(temp), timeout=120)
    assert done.returncode == 0 and done.stdout.count("done") == 2, done.stderr
    assert sorted(p.name for p in temp.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_launcher_leaves_nothing_in_the_temporary_folder(tmp_path, sig):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = _started(tmp_path, temp)
    assert [p.name for p in temp.iterdir()]  # its folders while it runs
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig
    assert sorted(p.name for p in temp.iterdir()) == []


def test_what_a_killed_launcher_left_is_removed_by_the_next_launch_and_nothing_else(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = _started(tmp_path, temp)
    proc.kill()
    proc.wait(timeout=30)
    left = sorted(p.name for p in temp.iterdir())
    assert left and all(name.startswith((f"xshard-launch-{proc.pid}-", f"xshard-run-{proc.pid}-")) for name in left)
    # what must stay: a running launcher's folder (this test's pid), a folder of another host's launcher,
    # and the user's own folders and files
    kept = [f"xshard-run-{os.getpid()}-{_host()}-abcd", f"xshard-run-{proc.pid}-another_host-abcd",
            "xshard-launch-notapid", "my-data"]
    for name in kept:
        (temp / name).mkdir()
        (temp / name / "file").write_text("keep")
    (temp / "notes.txt").write_text("keep")
    time.sleep(0.5)  # the killed launcher's ranks have followed it (parent-death signal)
    script = tmp_path / "train.py"
    script.write_text("import xshard\nxshard.Accelerator()\n")
    done = subprocess.run([sys.executable, "-m", "xshard", "launch", "--nproc", "1", str(script)],
                          capture_output=True, text=True, env=_env(temp), timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in temp.iterdir()) == sorted([*kept, "notes.txt"])
    assert all((temp / name / "file").read_text() == "keep" for name in kept)
