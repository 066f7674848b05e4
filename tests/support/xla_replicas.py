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

from support.deadline import fit

ROOT = Path(__file__).resolve().parents[2]


def run_replicas(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` XLA:CPU replicas; results in rank order.

    One run, no retry: a replica's failure, XLA:CPU's abort in a collective included, fails the test
    with the replica's stderr. ``timeout`` ends before the test's pytest-timeout (``support.deadline.fit``).
    """
    return _run_once(fn, world_size, args, fit(timeout))


def run_command(cmd: list[str], env: dict[str, str], timeout: float = 270) -> subprocess.CompletedProcess:
    """``cmd`` (e.g. ``xshard launch`` on XLA:CPU) as a user runs it, once, from the repository root; ``timeout``
    ends before the test's pytest-timeout (``support.deadline.fit``)."""
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=fit(timeout), cwd=ROOT)


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    from xshard.backends.devices.xla import cpu_replicas_env

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
                raise AssertionError(
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
