"""torchrun: PyTorch's elastic launcher (``torch.distributed.run``), for backends with a c10d group.

It runs inside the launcher's process, so a failure is reported with the rank that died and that
rank's own exit code (torchrun alone exits 1 whatever the worker's code was). When one rank fails,
torchrun stops the others; nothing is left waiting in a collective. One node uses a private
rendezvous on a free port unless ``--master_port`` is given; several nodes use the static rendezvous
at ``--master_addr:--master_port`` with ``--node_rank``. Each worker starts behind the parent-death
guard, which then runs the script exactly as torchrun would (``python -u script ...``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from .base import GUARD, Launcher, LaunchError, LaunchPlan, LaunchRequest, exit_code

#: a file that outlives the ranks of a job with restarts: the ranks note there where they save
#: checkpoints, so that restarted ranks resume from them (``xshard.checkpoint.auto_resume``)
RESUME_FILE_ENV = "XSHARD_RESUME_FILE"


def free_port() -> int:
    """A TCP port that is free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TorchrunLauncher(Launcher):
    """N processes per node with torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK, ...)."""

    name = "torchrun"

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        if request.nproc is None:
            raise LaunchError(f"the {request.backend} backend cannot count its devices here: give --nproc")
        env = dict(request.env)
        if request.nproc > 1 and "OMP_NUM_THREADS" not in request.parent_env:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's own default, set here without its banner
        argv = [*_torchrun_options(request), *request.command]
        return LaunchPlan(self, request.backend, request.nproc, env, argv, list(request.script_args))

    def run(self, plan: LaunchPlan) -> int:
        from torch.distributed import DistError
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError
        from torch.distributed.run import parse_args, run

        from ..environment import env_override
        from .parent_death import PARENT_ENV

        # The script's arguments are set after parsing: torchrun's parser would otherwise read an
        # argument such as "--nproc 5" meant for the script as an (ambiguous) option of its own.
        args = parse_args(list(plan.argv))
        script = ["-m", args.training_script] if args.module else [args.training_script]
        # Each worker runs `python -u <guard> python -u <script> <args>`: the guard sets the parent-death
        # signal and becomes the script (same pid, so torchrun's bookkeeping holds).
        args.module = False
        args.training_script = str(GUARD)
        args.training_script_args = [sys.executable, "-u", *script, *plan.script_args]
        try:
            with tempfile.TemporaryDirectory(prefix="xshard-run-") as run_dir, env_override(**{
                PARENT_ENV: str(os.getpid()),
                RESUME_FILE_ENV: os.environ.get(RESUME_FILE_ENV) or os.path.join(run_dir, "checkpoint-folder"),
            }):
                run(args)
        except ChildFailedError as exc:
            code, message = failure_report(exc.failures)
            print(message, file=sys.stderr)
            return code
        except SignalException as exc:  # torchrun has already passed the signal on to the ranks
            print(f"xshard launch: got {exc.sigval.name}; the ranks were stopped", file=sys.stderr)
            return 128 + int(exc.sigval)
        except (RendezvousError, DistError) as exc:  # the agents never met (DistError: the store timed out)
            print(f"xshard launch: the nodes could not meet ({type(exc).__name__}: {exc}); check that every node "
                  "runs `xshard launch` with the same --nnodes, --master_addr and --master_port, and that node 0 "
                  "is reachable on that port (--join_timeout sets how long to wait)", file=sys.stderr)
            return 1
        return 0


def _torchrun_options(request: LaunchRequest) -> list[str]:
    args = [f"--nproc-per-node={request.nproc}", f"--max-restarts={request.max_restarts}"]
    if request.nnodes == 1 and request.master_port is None:
        args.append("--standalone")  # private c10d rendezvous on a free port
        return args
    port = request.master_port
    if port == 0:
        if request.nnodes > 1:
            raise LaunchError(
                "--master_port 0 picks a free port on this machine, which the other nodes cannot know: "
                "give every node the same port number"
            )
        port = free_port()
    if port is None:
        raise LaunchError("--nnodes > 1 needs --master_port (the same on every node) and --master_addr")
    args += [
        f"--nnodes={request.nnodes}", f"--node-rank={request.node_rank}",
        f"--master-addr={request.master_addr}", f"--master-port={port}",
    ]
    if request.join_timeout is not None:
        args.append(f"--rdzv-conf=timeout={int(request.join_timeout)}")
    return args


def failure_report(failures: Mapping[int, Any]) -> tuple[int, str]:
    """The job's exit code and one message naming the rank that failed first (and the others).

    torchrun records failure times in whole seconds, so several ranks can tie. A rank that torchrun
    itself stopped (SIGTERM, after the first failure) is never the cause when another rank tied
    with it; among the rest the lowest rank is named first.
    """
    stopped_code = -int(signal.SIGTERM)

    def order(item: tuple[int, Any]) -> tuple[int, bool, int]:
        rank, failure = item
        return failure.timestamp, failure.exitcode == stopped_code, rank

    ranked = sorted(failures.items(), key=order)
    first_rank, first = ranked[0]
    code = exit_code(first.exitcode) or 1
    parts = [f"rank {first_rank} (local rank {first.local_rank}) failed with exit code {code}"]
    for rank, failure in ranked[1:]:
        what = "was stopped" if failure.exitcode == stopped_code else f"exited with code {exit_code(failure.exitcode)}"
        parts.append(f"rank {rank} {what}")
    return code, "xshard launch: " + "; ".join(parts) + ". The output above shows the cause."
