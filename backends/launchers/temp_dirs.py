"""The launcher's temporary folders: named after the launcher that made them, removed when it ends.

`xshard launch` keeps a few things in temporary folders while a job runs (the marks its processes leave,
the file that carries the checkpoint folder across restarts, torchrun's per-rank error files). Each one
is named ``xshard-<kind>-<pid>-<host>-<random>`` and removed when the launcher ends, normally or on
SIGINT/SIGTERM. A launcher killed with SIGKILL cannot remove its own: the next launch on the same
host removes those whose launcher (the pid in the name, on this host, owned by this user) is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

_KINDS = ("launch", "run")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def job_temp_dir(kind: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder of this launcher (``kind``: "launch" or "run"), removed when the block ends."""
    assert kind in _KINDS, kind
    return tempfile.TemporaryDirectory(prefix=f"xshard-{kind}-{os.getpid()}-{_host()}-")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale(folder: str | None = None) -> list[Path]:
    """Remove the temporary folders that launchers on this host, since killed, left in ``folder`` (the
    temporary folder by default); returns what was removed. Only folders named as ``job_temp_dir``
    names them, owned by this user, whose launcher's pid is not running."""
    root = Path(folder or tempfile.gettempdir())
    pattern = re.compile(rf"^xshard-(?:{'|'.join(_KINDS)})-(\d+)-{re.escape(_host())}-[^/]+$")
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for path in entries:
        found = pattern.match(path.name)
        if found is None or int(found.group(1)) == os.getpid():
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if not path.is_dir() or path.is_symlink() or info.st_uid != os.getuid() or _running(int(found.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
