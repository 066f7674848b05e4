"""Start one fresh set of processes (one per rank) for a benchmark configuration and collect their results.

Each rank is the benchmark script itself, re-run with worker arguments and torchrun's environment
contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A worker writes one JSON object to
the file named by ``BENCH_RESULT_FILE``. Every configuration gets its own processes and its own port,
so no process group, allocator or thread pool carries over from one measurement to the next.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT_ENV = "BENCH_RESULT_FILE"


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    """A rank exited with an error; carries the tail of its output."""


def run_ranks(
    argv: list[str], world_size: int, env: dict[str, str] | None = None, timeout: float = 1800.0
) -> list[dict[str, Any]]:
    """Run ``python argv...`` as ``world_size`` ranks at once; return each rank's result, in rank order.

    ``OMP_NUM_THREADS`` defaults to 1 per rank (the ranks share the machine's cores).
    Raises RankFailure with the failing rank's output when any rank exits non-zero or writes nothing.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="xshard-bench-") as tmp:
        procs = []
        for rank in range(world_size):
            rank_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
            rank_env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )
            rank_env[RESULT_ENV] = str(Path(tmp) / f"rank{rank}.json")
            log = open(Path(tmp) / f"rank{rank}.log", "w+")  # closed in the finally below
            procs.append((subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        try:
            codes = _wait_all([p for p, _ in procs], timeout)
        finally:
            outputs = []
            for _, log in procs:
                log.seek(0)
                outputs.append(log.read())
                log.close()
        results = []
        for rank, code in enumerate(codes):
            path = Path(tmp) / f"rank{rank}.json"
            if code != 0 or not path.exists():
                bad = next((r for r, c in enumerate(codes) if c != 0), rank)
                raise RankFailure(f"rank {bad} exited with {codes[bad]}:\n{_tail(outputs[bad])}")
            results.append(json.loads(path.read_text()))
        return results


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes of all ranks; once one rank fails the others would block in a collective: stop them."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if time.monotonic() > deadline:
                raise RankFailure(f"ranks did not finish within {timeout:.0f} s")
            return [p.wait() for p in procs]
        time.sleep(0.2)


def write_result(result: dict[str, Any]) -> None:
    """Called by a worker: hand this rank's result back to ``run_ranks``."""
    Path(os.environ[RESULT_ENV]).write_text(json.dumps(result))


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
