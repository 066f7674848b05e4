"""Run a script on a tmpfs of its own: a full disk or a read-only folder, for real, without touching the machine's.

``unshare -rm`` gives the script a private mount namespace (as an unprivileged user where the kernel allows it)
in which a small tmpfs is mounted; nothing outside the namespace sees it. Where the machine forbids the mount
the test is skipped, with the reason (counted by pytest's summary).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_on_private_tmpfs(tmp_path: Path, script: str, options: str, *args: str, timeout: float = 270,
                         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Mount a tmpfs with ``options`` (``size=1m``, ``ro``...) and run ``script`` with the mount point and ``args``;
    returns the finished process and the mount point. Skips where no private tmpfs can be mounted."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a private tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    path = tmp_path / "script.py"
    path.write_text(script)
    shell = " ".join([f"mount -t tmpfs -o {options} tmpfs {mount} &&", sys.executable, str(path), str(mount), *args])
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0 and "mount" in proc.stderr and not proc.stdout:
        pytest.skip(f"this machine does not allow a private tmpfs: {proc.stderr.strip()[-200:]}")
    return proc, mount


def output_lines(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The script's ``KEY:value`` lines."""
    return dict(line.split(":", 1) for line in proc.stdout.splitlines() if ":" in line)
