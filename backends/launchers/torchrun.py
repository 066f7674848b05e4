"""torchrun: PyTorch's elastic launcher (``torch.distributed.run``), for backends with a c10d group.

It runs inside the launcher's process, so a failure is reported with the rank that died and that
rank's own exit code (torchrun alone exits 1 whatever the worker's code was). When one rank fails,
torchrun stops the others; nothing is left waiting in a collective. Each worker starts behind the
parent-death guard, which then runs the script exactly as torchrun would (``python -u script ...``).

What listens where. A TCPStore has no authentication: whoever reaches its port can read and write
the job's keys. So a single-node job (no ``--master_port``, or one on a loopback ``--master_addr``)
binds both of its stores to 127.0.0.1 and nothing else: the rendezvous store, created here on a free
port (or the given one), and the store the ranks share (``MASTER_ADDR``/``MASTER_PORT``), which
torchrun's ``--standalone`` would open on every interface. Several nodes use the static rendezvous
at ``--master_addr:--master_port`` with ``--node_rank``: node 0's store listens on that port of every
interface, as it must for the other nodes to reach it; keep that port inside a trusted network.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from ...errors import culprit_rank
from ..world import DEFAULT_MASTER_ADDR as _LOOPBACK  # this machine's rendezvous address
from .base import GUARD, Launcher, LaunchError, LaunchPlan, LaunchRequest, exit_code
from .store_link import DEFAULT_SECONDS, StoreLinkGuard
from .temp_dirs import job_temp_dir

#: a file that outlives the ranks of a job with restarts: the ranks note there where they save
#: checkpoints, so that restarted ranks resume from them (``xshard.checkpoint.auto_resume``)
RESUME_FILE_ENV = "XSHARD_RESUME_FILE"


def port_in_use(port: int | str) -> str:
    """The one line for a rendezvous port that another program already listens on."""
    return (f"--master_port {port}: the port is in use on this machine (another job or program listens on it); "
            "choose another with --master_port N, or leave --master_port out on one node to pick a free one")


def free_port() -> int:
    """A TCP port that is free on this machine now."""
    with socket.socket() as s:
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


def loopback_store(port: int = 0) -> Any:
    """A TCPStore server that listens on 127.0.0.1 only (``port`` 0: a free one); ``.port`` says which.

    TCPStore itself binds every interface, so the socket is bound here and handed over
    (``master_listen_fd``); it stays open as long as the store lives.
    """
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((_LOOPBACK, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(port_in_use(port)) from None
        raise
    sock.listen(1024)
    store = TCPStore(_LOOPBACK, sock.getsockname()[1], is_master=True, master_listen_fd=sock.fileno(),
                     multi_tenant=True, wait_for_workers=False)
    _KEEP_OPEN.append((store, sock))
    return store


_KEEP_OPEN: list[Any] = []


def _single_node_on_loopback(args: Any) -> Any:
    """For a single-node job (``--standalone``, or one node at a loopback ``--master-addr``), turn
    torchrun's parsed options into a c10d rendezvous whose store listens on 127.0.0.1 only (the given
    port, or a free one), and return the context under which the ranks' store does too; for any
    other job, a context that changes nothing."""
    static_here = (str(args.nnodes) == "1" and args.rdzv_backend == "static"
                   and args.master_addr in (_LOOPBACK, "localhost"))
    if not (args.standalone or static_here):
        return contextlib.nullcontext()
    store = loopback_store(0 if args.standalone else int(args.master_port))
    args.standalone = False
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", f"{_LOOPBACK}:{store.port}", str(uuid.uuid4())
    args.rdzv_conf = "is_host=false"  # the store above is the host; torchrun's own process joins it
    args.local_addr = _LOOPBACK  # what the ranks get as MASTER_ADDR
    return _ranks_store_on_loopback()


@contextlib.contextmanager
def _ranks_store_on_loopback() -> Iterator[None]:
    """torchrun's dynamic rendezvous opens the store the ranks share with ``TCPStore(is_master=True)``
    on every interface; while this block runs it opens it on 127.0.0.1 instead."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler._create_tcp_store_server
    DynamicRendezvousHandler._create_tcp_store_server = (  # type: ignore[method-assign]
        lambda self, master_addr, master_port: loopback_store(master_port))
    try:
        yield
    finally:
        DynamicRendezvousHandler._create_tcp_store_server = original  # type: ignore[method-assign]


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
        link = _store_link(args)
        try:
            with job_temp_dir("run") as run_dir, env_override(**{
                PARENT_ENV: str(os.getpid()),
                RESUME_FILE_ENV: os.environ.get(RESUME_FILE_ENV) or os.path.join(run_dir, "checkpoint-folder"),
            }), _single_node_on_loopback(args), link:
                # torchrun's per-rank error files: in this launcher's folder, not a torchelastic_* folder of
                # the system's temporary folder that nothing removes
                args.log_dir = args.log_dir or os.path.join(run_dir, "torchelastic")
                run(args)
        except ChildFailedError as exc:
            code, message = failure_report(exc.failures)
            print(message, file=sys.stderr)
            return code
        except SignalException as exc:  # torchrun has already passed the signal on to the ranks
            print(f"xshard launch: got {exc.sigval.name}; the ranks were stopped", file=sys.stderr)
            return 128 + int(exc.sigval)
        except (RendezvousError, DistError) as exc:  # the agents never met (DistError: the store timed out)
            plan.failed_before_scripts = True
            if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                port = next((a.split("=", 1)[1] for a in plan.argv if a.startswith("--master-port=")), "")
                print(f"xshard launch: error: {port_in_use(port)}", file=sys.stderr)
                return 1
            if isinstance(link, StoreLinkGuard) and link.guarded and not isinstance(exc, RendezvousError) \
                    and "refused" not in str(exc):  # they had met: node 0 was lost since
                print(f"xshard launch: node 0 (the job's store at {args.master_addr}:{args.master_port}) is "
                      f"unreachable from this node: the connection to it failed ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0]}) after the nodes had met, with no acknowledgement for "
                      f"{link.milliseconds / 1000:.0f} s; it is down or cut off from this one. This node's ranks "
                      "were stopped: check the network, then start the job again on every node (it resumes from "
                      "the last checkpoint).", file=sys.stderr)
                return 1
            print(f"xshard launch: the nodes could not meet ({type(exc).__name__}: {exc}); check that every node "
                  "runs `xshard launch` with the same --nnodes, --master_addr and --master_port, and that node 0 "
                  "is reachable on that port (--join_timeout sets how long to wait)", file=sys.stderr)
            return 1
        return 0


def _store_link(args: Any) -> Any:
    """For a job of several nodes, the guard on this launcher's connections to node 0's store
    (``store_link.py``; ``--join_timeout`` sets its seconds); otherwise a context that does nothing."""
    if str(args.nnodes) == "1" or args.rdzv_backend != "static" or args.master_port is None:
        return contextlib.nullcontext()
    seconds = DEFAULT_SECONDS
    for item in str(args.rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "timeout" and value.strip():
            seconds = float(value)
    return StoreLinkGuard(int(args.master_port), seconds)


def _torchrun_options(request: LaunchRequest) -> list[str]:
    args = [f"--nproc-per-node={request.nproc}", f"--max-restarts={request.max_restarts}"]
    if request.nnodes == 1 and request.master_port is None:
        args.append("--standalone")  # private c10d rendezvous on a free port (on 127.0.0.1: see run)
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

    torchrun records failure times in whole seconds, so several ranks can tie. A rank that failed
    because of a peer (its error, which an xshard rank leaves where torchrun reads it, is a
    ``RankDiedError`` or ``CollectiveTimeoutError``) or that torchrun itself stopped (SIGTERM, after the
    first failure) is never the cause when another rank tied with it; among the rest the lowest rank is
    named first, with its exception where the rank left it. A rank whose error names the rank it stopped
    because of (``xshard.errors.because_of``: a save that another rank could not write) makes that rank the
    one that failed, whenever each exited, and the ranks that stopped are said to have stopped because of it.
    """
    stopped_code = -int(signal.SIGTERM)

    def order(item: tuple[int, Any]) -> tuple[int, bool, bool, int]:
        rank, failure = item
        return failure.timestamp, _error_of(failure).startswith(_PEER_ERRORS), failure.exitcode == stopped_code, rank

    ranked = sorted(failures.items(), key=order)
    # A rank that stopped because another one failed names it (``xshard.errors.because_of``): that rank is the
    # cause, whichever exited first, and the ranks that named it stopped because of it
    culprits = [culprit_rank(_error_of(failure)) for _, failure in ranked]
    named = next((rank for rank in culprits if rank is not None and rank in failures), None)
    because = {rank for (rank, _), culprit in zip(ranked, culprits, strict=True) if named is not None and culprit == named}
    if named is not None:
        ranked.sort(key=lambda item: item[0] != named)
    first_rank, first = ranked[0]
    error = _error_of(first)
    code = exit_code(first.exitcode) or 1
    if first.exitcode == stopped_code and error and not error.startswith(_PEER_ERRORS):
        # its script raised (the error file says what), and torchrun's SIGTERM, sent when a peer that learnt
        # of the crash exited first, came while the process was ending: the job failed by the exception,
        # whose exit code is Python's 1, not 143 (which would say a signal stopped a healthy job)
        code = 1
    if named == first_rank and first.exitcode == stopped_code and not error:
        # the peers say it failed, and torchrun's SIGTERM came before its script's exception reached the launcher
        code, error = 1, "its error is in its output above: it was stopped before it could report it"
    parts = [f"rank {first_rank} (local rank {first.local_rank}) failed with exit code {code}"
             + (f" ({error})" if error else "")]
    for rank, failure in ranked[1:]:
        if named == first_rank and (rank in because or failure.exitcode == stopped_code):
            what = "was stopped because of it"
        elif failure.exitcode == stopped_code:
            what = "was stopped"
        else:
            what = f"exited with code {exit_code(failure.exitcode)}"
        parts.append(f"rank {rank} {what}")
    return code, "xshard launch: " + "; ".join(parts) + ". The output above shows the cause."


#: the errors of a rank that failed because of a peer (``xshard.errors``; a save's: ``OtherRankSaveError``)
_PEER_ERRORS = ("RankDiedError", "CollectiveTimeoutError", "OtherRankSaveError")


def _error_of(failure: Any) -> str:
    """The exception a failed rank left in its error file (first line), or "" where it left none."""
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    text = message.get("message") if isinstance(message, dict) else None
    return str(text).splitlines()[0][:_ERROR_CHARS] if text else ""


#: how much of a rank's error the launcher's last line carries (a config error's whole line fits)
_ERROR_CHARS = 600
