"""Run a function in N real processes on gloo, the way torchrun would start them.

``run_workers(fn, world_size, *args)`` starts ``world_size`` fresh processes with torchrun's
environment contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
and returns each rank's return value, in rank order. A worker's exception fails the caller with
that worker's traceback; a hung job fails after ``timeout`` seconds instead of hanging the suite, with
every worker's Python stacks from shortly before the deadline (where each one was waiting).
``fn`` must be a module-level function (it is pickled by reference).

The processes come from a fork server (``CONTEXT``) that imported torch, ``torch._dynamo`` and xshard
once for the whole session: a rank starts without the ~1.6 s of CPU that importing torch costs, nor the
~2 s of ``torch._dynamo``, which torch imports at a rank's first optimizer (``Optimizer.add_param_group``
is ``torch._disable_dynamo``d) or first model (xshard's hooks are ``torch.compiler.disable``d): over the
suite's hundreds of ranks on a 2-core machine that is minutes (measured: tests/test_checkpoint.py,
test_checkpoint_portable.py and test_semantics_users.py together, 82-92 s without ``torch._dynamo`` in
the server, 45 s with it). Neither starts a thread, so the fork is safe; transformers is not preloaded
(its import starts one). Each rank is still a new process with no
process group, no threads and no state from earlier tests (the server forks before anything runs),
and it takes the parent's environment as it is at the call (a fork server's children would otherwise
see the environment of the moment the server started). Like every forked multiprocessing child, a rank
ends with ``os._exit`` once ``fn`` returns, so ``atexit`` handlers do not run in it: a test of what
happens at a process's exit runs a script (``xshard launch``, torchrun or ``python``) instead.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from support.deadline import fit

#: where every test world's processes come from (see the module docstring)
START_METHOD = "forkserver"
CONTEXT = multiprocessing.get_context(START_METHOD)
CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "xshard"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: seconds before the parent's deadline at which each worker writes its stacks
_STACKS_AHEAD_S = 10


def _entry(rank: int, fn: Callable, world_size: int, port: int, outdir: str, env: dict, args: tuple,
           timeout: float, parent_env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment at the call, not the fork server's (module docstring)
    os.environ.update(parent_env)
    stacks = open(Path(outdir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.dump_traceback_later(max(1.0, timeout - _STACKS_AHEAD_S), file=stacks)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    os.environ.update(env)
    torch.set_num_threads(1)
    out = Path(outdir) / f"rank{rank}.pt"
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # report everything, including SystemExit, to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _stacks(outdir: str) -> str:
    parts = []
    for path in sorted(Path(outdir).glob("rank*.stacks")):
        text = path.read_text().strip()
        finished = path.with_suffix(".pt").exists()
        parts.append(f"--- {path.stem}\n{text[-4000:] or ('(finished)' if finished else '(no stacks written)')}")
    return "\n".join(parts)


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240, env: dict[str, str] | None = None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results by rank.

    ``timeout`` is shortened to end before the running test's pytest-timeout (``support.deadline.fit``),
    so that a hang is reported here, with the ranks' stacks."""
    timeout = fit(timeout)
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), outdir, dict(env or {}), args, timeout, dict(os.environ)),
            nprocs=world_size, join=False, start_method=START_METHOD,
        )
        import time

        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout}s; "
                                       f"where each rank was {_STACKS_AHEAD_S}s before:\n{_stacks(outdir)}")
        except mp.ProcessRaisedException:
            pass  # the worker's own traceback is in its result file; report that below
        except mp.ProcessExitedException:
            pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results, failures = [], []
        for rank in range(world_size):
            path = Path(outdir) / f"rank{rank}.pt"
            if not path.exists():
                code = ctx.processes[rank].exitcode
                failures.append((0, f"rank {rank} of {fn.__name__} died without a result (exit code {code})"))
                continue
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                # a rank that only saw another's failure (a peer gone mid-collective) comes after the cause
                consequence = any(name in payload["error"] for name in _CONSEQUENCES)
                failures.append((int(consequence), f"rank {rank} of {fn.__name__} failed:\n{payload['error']}"))
                continue
            results.append(payload["result"])
        if failures:
            raise RuntimeError("\n\n".join(message for _, message in sorted(failures, key=lambda f: f[0])))
        return results


#: errors a rank raises because another rank failed first
_CONSEQUENCES = ("RankDiedError", "CollectiveTimeoutError", "Connection closed by peer", "Connection reset by peer")
