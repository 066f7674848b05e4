"""Run a function on N XLA:CPU replicas, started by torch_xla's own launcher (``xmp.spawn``).

``run_replicas(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` once per replica in a
fresh Python process (torch_xla refuses to launch replicas once its runtime has started, as it
has in a test process that used one XLA device) and returns each replica's return value in rank
order. The launcher forks (torch_xla is imported, its runtime not yet started), which saves a
second import of torch_xla per test. On XLA:CPU the replicas are threads of that process, one per virtual device
(``CPU_NUM_DEVICES``). A replica's exception fails the caller with its traceback; a hang is cut
after ``timeout`` seconds. ``fn`` must be a module-level function of an importable module.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


#: what XLA:CPU prints when it kills the process in a first collective that a replica reached late
RENDEZVOUS_ABORT = "Termination timeout for"
ATTEMPTS = 4


class RendezvousAbort(AssertionError):
    """XLA:CPU aborted a first collective because one replica thread was still compiling."""


def run_replicas(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` XLA:CPU replicas; results in rank order.

    XLA:CPU replicas are threads that each compile their own copy of a graph; the first to finish
    waits in the graph's first collective for the others, and XLA:CPU kills the process when that
    wait passes a fixed 10 seconds (no flag raises it in torch_xla 2.9). On a 2-core machine one
    compile can lag that much, even with nothing else running. That abort, and only that, is retried
    (``ATTEMPTS`` runs in all); if every attempt ends that way the test is skipped with the reason.
    Any other failure fails the test at once.
    """
    import pytest

    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except RendezvousAbort as exc:
            last = exc
            print(f"attempt {attempt}/{ATTEMPTS}: XLA:CPU aborted a slow first rendezvous", file=sys.stderr)
    pytest.skip(f"XLA:CPU's fixed 10 s first-collective rendezvous was exceeded in all {ATTEMPTS} attempts "
                f"(a replica thread still compiling); last error:\n{str(last)[-1500:]}")


def run_command(cmd: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``cmd`` (e.g. ``xshard launch`` on XLA:CPU) as a user runs it, from the repository root, rerun
    where XLA:CPU aborted a slow first rendezvous (see ``run_replicas``), else returned as it ended;
    skipped with the reason when every attempt ends in that abort."""
    import pytest

    for _ in range(ATTEMPTS):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if RENDEZVOUS_ABORT not in proc.stderr:
            return proc
        print("XLA:CPU aborted a slow first rendezvous; running the command again", file=sys.stderr)
    pytest.skip(f"XLA:CPU's fixed 10 s first-collective rendezvous was exceeded in all {ATTEMPTS} attempts")


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    from xshard.backends.xla import cpu_replicas_env

    with tempfile.TemporaryDirectory() as outdir:
        torch.save(args, Path(outdir) / "args.pt")
        env = {**os.environ, **cpu_replicas_env(world_size)}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
        target = f"{fn.__module__}:{fn.__qualname__}"
        try:
            proc = subprocess.run(
                [sys.executable, __file__, target, outdir], env=env, capture_output=True, text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{world_size} XLA replicas of {target} hung for {timeout}s") from exc
        results = []
        for rank in range(world_size):
            path = Path(outdir) / f"rank{rank}.pt"
            if not path.exists():
                error = RendezvousAbort if RENDEZVOUS_ABORT in proc.stderr else AssertionError
                raise error(
                    f"replica {rank} of {target} left no result (exit code {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}"
                )
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise AssertionError(f"replica {rank} of {target} failed:\n{record['error']}")
            results.append(record["result"])
        return results


def _replica(index: int, target: str, outdir: str) -> None:
    import torch_xla.runtime as xr

    rank, world_size = xr.global_ordinal(), xr.world_size()
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    args = torch.load(Path(outdir) / "args.pt", weights_only=False)
    out = Path(outdir) / f"rank{rank}.pt"
    try:
        torch.save({"ok": True, "result": fn(rank, world_size, *args)}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise


if __name__ == "__main__":
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_replica, args=(sys.argv[1], sys.argv[2]), start_method="fork")
