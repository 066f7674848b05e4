"""The process the xla launcher starts: ``xmp.spawn`` of the user's script.

    python -m xshard.backends.launchers.xla_spawn 1|all SCRIPT [ARGS...]
    python -m xshard.backends.launchers.xla_spawn 1|all -m MODULE [ARGS...]

``1`` runs one replica in this process; ``all`` one process per local device (each dies with this
one). The exit code is the script's (``sys.exit(n)`` in a replica included); a replica's exception
is printed with its traceback and exits 1. With several replicas, the first that fails ends the job
(``run_script``), and this process says which. SIGINT or SIGTERM here stops the replica processes with
SIGTERM (their replicas are threads, which only a process-wide signal stops) and exits 128 + N.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile


def main(argv: list[str]) -> int:
    """Spawn the replicas and wait for them; the job's exit code."""
    if len(argv) < 2 or argv[0] not in ("1", "all"):
        print("usage: xla_spawn 1|all SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    from concurrent.futures.process import BrokenProcessPool

    import torch_xla.distributed.xla_multiprocessing as xmp

    from .xla import failed_replica, run_script

    one = argv[0] == "1"
    received: list[int] = []
    if not one:  # with one replica the script runs here and receives the signal itself

        def stop_replicas(signum: int, frame: object) -> None:
            received.append(signum)
            for child in multiprocessing.active_children():
                if child.pid is None:  # not started (active_children() holds started ones only)
                    continue
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop_replicas)
    fd, failures = tempfile.mkstemp(prefix="xshard-xla-failures-")
    os.close(fd)
    try:
        xmp.spawn(run_script, args=(argv[1:], os.getpid(), None if one else failures), nprocs=1 if one else None)
    except BrokenProcessPool as exc:
        if received:
            return 128 + received[0]
        failed = failed_replica(failures)
        if failed is not None:
            print(f"xshard launch: replica {failed[0]} failed (its message is above), so the job was stopped, "
                  "as torchrun stops a job when one of its ranks fails", file=sys.stderr)
            return failed[1]
        print(f"xshard launch: an xla replica process died ({exc})", file=sys.stderr)
        if os.environ.get("PJRT_DEVICE", "").strip().upper() == "CPU" and not one:
            print(f"xshard launch: {_abort_hint(os.environ.get('PJRT_CPU_ASYNC_CLIENT'))}", file=sys.stderr)
        return 1
    finally:
        os.unlink(failures)
    return 0


def _abort_hint(async_client: str | None) -> str:
    """Why XLA:CPU may have ended the replicas' process, and what to do (``async_client``: the
    ``PJRT_CPU_ASYNC_CLIENT`` the replicas ran with; the launcher sets 0, see ``cpu_replicas_env``)."""
    reason = ("XLA:CPU's replicas are threads of that process, and XLA ends it when one waits more than a fixed "
              "10 s in a collective for another (a 'Termination timeout' line above)")
    if (async_client or "1").strip().lower() not in ("0", "false"):  # torch_xla's default is asynchronous
        return (f"{reason}. The replicas ran on torch_xla's asynchronous CPU client (PJRT_CPU_ASYNC_CLIENT="
                f"{async_client or 'unset'}), where one replica's next graph can wait for a device lock while the "
                "other waits in its collective: set PJRT_CPU_ASYNC_CLIENT=0, as `xshard launch` does unless it was "
                "exported")
    return (f"{reason}: a replica was held up, compiling a large graph or starved on a busy machine. XLA:CPU is a "
            "testing mode: retry on a quieter machine, use --nproc 1, or run the same script on the cpu backend "
            "(XSHARD_BACKEND=cpu)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
