"""`xshard launch`: start one training script on N processes per node, on any backend.

Examples:
  xshard launch --nproc 2 train.py --lr 3e-4
  xshard launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 train.py
  xshard launch --backend cuda --devices 0,2 --config ds_config.json train.py

cpu, cuda and npu start processes with torchrun; xla with torch_xla's launcher (one process per local
chip; run it on every host of a pod); mps runs one process. The job's exit code is that of the
first rank that failed, and the message names that rank.

The launcher asks the selected Backend how to start processes (``Backend.launcher()``):

- ``"torchrun"`` (cpu, cuda, npu): PyTorch's own elastic launcher (``torch.distributed.run``), called
  in this process so that a failure can be reported with the rank that died and that rank's exit
  code (torchrun alone exits 1 whatever the worker's code was). When one rank fails, torchrun
  stops the others; nothing is left waiting in a collective. One node uses a private rendezvous on
  a free port unless ``--master_port`` is given; several nodes use the static rendezvous at
  ``--master_addr:--master_port`` with ``--node_rank``.
- ``"xla"``: torch_xla's launcher (``torch_xla.distributed.xla_multiprocessing.spawn``), which starts
  one process per local TPU chip (PJRT) and runs the script in each as ``__main__``. On a TPU pod,
  run `xshard launch` on every host (e.g. ``gcloud ... tpu-vm ssh --worker=all``): torch_xla finds
  the other hosts itself, so ``--nnodes``/``--node_rank``/``--master_*`` do not apply.
- ``"single"`` (mps): the script runs in one child process; asking for more is an error.

Children get ``XSHARD_BACKEND`` (the backend chosen here, so every rank agrees), ``XSHARD_CONFIG``
(``--config``, an absolute path) and the backend's visible-devices variable (``--devices``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xshard.backends import ENV_VAR, Backend, World, apply_visible_devices, parse_devices, select
from xshard.backends.errors import XShardError

CONFIG_ENV = "XSHARD_CONFIG"


class LaunchError(XShardError, ValueError):
    """The launch options cannot work (the message says which option and what to use instead)."""


@dataclass
class LaunchOptions:
    """What the user asked `xshard launch` for (the command-line options, as data)."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc: int | None = None
    nnodes: int | None = None
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    devices: str | None = None
    backend: str | None = None
    config: str | None = None
    module: bool = False
    max_restarts: int = 0
    join_timeout: int | None = None


@dataclass
class LaunchPlan:
    """How the job will be started: which launcher, its arguments, and the children's environment."""

    launcher: str  # "torchrun" | "xla" | "single"
    backend: str
    nproc: int
    env: dict[str, str]
    #: torchrun: its options and the script; single: the child's command line up to the script;
    #: xla: the script (run as __main__ in each spawned process)
    argv: list[str]
    #: the script's own arguments, passed through untouched
    script_args: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the log: what is about to run."""
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        command = " ".join([*self.argv, *self.script_args])
        return f"{self.launcher} x{self.nproc} [{self.backend}] {command}  ({extra})"


def free_port() -> int:
    """A TCP port that is free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _visible_devices(backend_cls: type[Backend], devices: str) -> tuple[dict[str, str], int]:
    """The children's visible-devices variable for ``--devices`` ("0,2"), and how many devices that is."""
    ids = parse_devices(devices)
    if not ids:
        raise LaunchError(f"--devices {devices!r}: give device indices separated by commas, e.g. 0,2")
    if backend_cls.visible_devices_env is None:
        raise LaunchError(
            f"--devices: the {backend_cls.name} backend has no visible-devices variable; "
            "leave --devices out and set --nproc instead"
        )
    # The check runs against this environment, so a different value the user exported is an error
    # (as the backend's rule says) rather than silently replaced.
    env = dict(os.environ)
    return apply_visible_devices(backend_cls, devices, env), len(ids)


def plan_launch(opts: LaunchOptions, env: Mapping[str, str] | None = None) -> LaunchPlan:
    """Check the options and decide how to start the job (no process is started)."""
    env = os.environ if env is None else env
    opts = _with_config_defaults(opts, env)
    selection = select(opts.backend, env=dict(env))
    backend = selection.cls(World())
    launcher = backend.launcher()
    child_env: dict[str, str] = {ENV_VAR: backend.name}

    if not opts.module and not Path(opts.script).is_file():
        raise LaunchError(f"the training script {opts.script!r} does not exist")
    if opts.config is not None:
        config_path = Path(opts.config)
        if not config_path.is_file():
            raise LaunchError(f"--config {opts.config!r}: no such file")
        child_env[CONFIG_ENV] = str(config_path.resolve())

    n_devices = None
    if opts.devices is not None:
        visible, n_devices = _visible_devices(selection.cls, opts.devices)
        child_env.update(visible)

    nproc = opts.nproc
    if nproc is None:
        nproc = n_devices if n_devices is not None else max(1, backend.device_count())
        if backend.max_world_size is not None:
            nproc = min(nproc, backend.max_world_size)
    if nproc < 1:
        raise LaunchError(f"--nproc {nproc}: give at least 1 process per node")
    if n_devices is not None and nproc > n_devices:
        raise LaunchError(f"--nproc {nproc} is more than the {n_devices} device(s) in --devices")
    if opts.nnodes < 1 or not 0 <= opts.node_rank < opts.nnodes:
        raise LaunchError(f"--node_rank {opts.node_rank} must be in 0..{opts.nnodes - 1} (--nnodes {opts.nnodes})")
    world = nproc * opts.nnodes
    if backend.max_world_size is not None and world > backend.max_world_size:
        raise LaunchError(
            f"the {backend.name} backend runs at most {backend.max_world_size} process(es), but --nproc {nproc}"
            f" x --nnodes {opts.nnodes} asks for {world}: {backend.world_size_hint()}"
        )

    script = [*(["-m"] if opts.module else []), opts.script]
    script_args = list(opts.script_args)
    if launcher == "torchrun":
        if nproc > 1 and "OMP_NUM_THREADS" not in env:
            child_env["OMP_NUM_THREADS"] = "1"  # torchrun's own default, set here without its banner
        return LaunchPlan("torchrun", backend.name, nproc, child_env, _torchrun_args(opts, nproc, script),
                          script_args)
    if launcher == "xla":
        if opts.nnodes != 1 or opts.node_rank != 0 or opts.master_port is not None:
            raise LaunchError(
                "--nnodes/--node_rank/--master_port do not apply to the xla launcher: run `xshard launch` on "
                "every host of the TPU slice; torch_xla finds the other hosts itself"
            )
        if opts.module:
            raise LaunchError("-m (run a module) is not supported by the xla launcher: pass the script's path")
        count = max(1, backend.device_count())
        if opts.nproc is not None and opts.nproc not in (1, count):
            raise LaunchError(
                f"--nproc {opts.nproc}: torch_xla starts either 1 process or one per local device ({count}); "
                "leave --nproc out, or use --devices to choose the chips"
            )
        return LaunchPlan("xla", backend.name, nproc, child_env, [opts.script], script_args)
    if launcher == "single":
        if opts.nnodes != 1:
            raise LaunchError(f"the {backend.name} backend runs one process on one machine: drop --nnodes")
        return LaunchPlan("single", backend.name, 1, child_env, [sys.executable, "-u", *script], script_args)
    raise LaunchError(f"the {backend.name} backend asks for an unknown launcher {launcher!r}")


def _with_config_defaults(opts: LaunchOptions, env: Mapping[str, str]) -> LaunchOptions:
    """Options left out on the command line come from the config file (backend, devices, num_nodes)."""
    from dataclasses import replace

    backend, nproc, nnodes = opts.backend, opts.nproc, opts.nnodes
    if opts.config is not None and Path(opts.config).is_file():
        from xshard.config import XShardConfig

        config = XShardConfig.load(opts.config, env=env, script_args=opts.script_args)
        if backend is None and config.backend != "auto":
            backend = config.backend
        nproc = config.devices if nproc is None else nproc
        nnodes = config.num_nodes if nnodes is None else nnodes
    return replace(opts, backend=backend, nproc=nproc, nnodes=1 if nnodes is None else nnodes)


def _torchrun_args(opts: LaunchOptions, nproc: int, script: list[str]) -> list[str]:
    args = [f"--nproc-per-node={nproc}", f"--max-restarts={opts.max_restarts}"]
    if opts.nnodes == 1 and opts.master_port is None:
        args.append("--standalone")  # private c10d rendezvous on a free port
    else:
        port = opts.master_port
        if port == 0:
            if opts.nnodes > 1:
                raise LaunchError(
                    "--master_port 0 picks a free port on this machine, which the other nodes cannot know: "
                    "give every node the same port number"
                )
            port = free_port()
        if port is None:
            raise LaunchError("--nnodes > 1 needs --master_port (the same on every node) and --master_addr")
        args += [
            f"--nnodes={opts.nnodes}", f"--node-rank={opts.node_rank}",
            f"--master-addr={opts.master_addr}", f"--master-port={port}",
        ]
        if opts.join_timeout is not None:
            args.append(f"--rdzv-conf=timeout={int(opts.join_timeout)}")
    return [*args, *script]


# ---------------------------------------------------------------------------- running


def run_plan(plan: LaunchPlan) -> int:
    """Start the job and wait for it; returns the job's exit code (a failed rank's own code)."""
    from xshard.backends.base import env_override

    with env_override(**plan.env):
        if plan.launcher == "torchrun":
            return _run_torchrun(plan.argv, plan.script_args)
        if plan.launcher == "xla":
            return _run_xla(plan)
        return subprocess.call([*plan.argv, *plan.script_args])


def _exit_code(code: int) -> int:
    """A process's exit code as a shell reports it (killed by signal N -> 128 + N)."""
    return 128 - code if code < 0 else code


def _failure_report(failures: Mapping[int, Any]) -> tuple[int, str]:
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
    code = _exit_code(first.exitcode) or 1
    parts = [f"rank {first_rank} (local rank {first.local_rank}) failed with exit code {code}"]
    for rank, failure in ranked[1:]:
        what = "was stopped" if failure.exitcode == stopped_code else f"exited with code {_exit_code(failure.exitcode)}"
        parts.append(f"rank {rank} {what}")
    return code, "xshard launch: " + "; ".join(parts) + ". The output above shows the cause."


def _run_torchrun(argv: Sequence[str], script_args: Sequence[str]) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    # The script's arguments are set after parsing: torchrun's parser would otherwise read an
    # argument such as "--nproc 5" meant for the script as an (ambiguous) option of its own.
    args = parse_args(list(argv))
    args.training_script_args = list(script_args)
    try:
        run(args)
    except ChildFailedError as exc:
        code, message = _failure_report(exc.failures)
        print(message, file=sys.stderr)
        return code
    except (RendezvousError, DistError) as exc:  # the agents never met (DistError: the store timed out)
        print(f"xshard launch: the nodes could not meet ({type(exc).__name__}: {exc}); check that every node "
              "runs `xshard launch` with the same --nnodes, --master_addr and --master_port, and that node 0 "
              "is reachable on that port (--join_timeout sets how long to wait)", file=sys.stderr)
        return 1
    return 0


def _xla_entry(index: int, script: str, script_args: list[str]) -> None:
    """Run the user's script as ``__main__`` inside one torch_xla process."""
    import runpy

    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


def _run_xla(plan: LaunchPlan) -> int:
    try:
        import torch_xla.distributed.xla_multiprocessing as xmp
    except ImportError as exc:
        raise LaunchError(f"the xla launcher needs torch_xla ({exc}): pip install torch_xla") from exc
    try:
        # nprocs=None: one process per local device (the only multi-process value torch_xla accepts)
        xmp.spawn(_xla_entry, args=(plan.argv[0], plan.script_args), nprocs=1 if plan.nproc == 1 else None)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # torch_xla re-raises a worker's exception here
        print(f"xshard launch: an xla process failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def launch(opts: LaunchOptions) -> int:
    """Plan and run: the whole of `xshard launch`."""
    from xshard.log import get_logger, setup_logging

    setup_logging()
    plan = plan_launch(opts)
    get_logger("xshard.launch").info("launching: %s", plan.describe())
    return run_plan(plan)


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `xshard launch` (underscore and dash spellings both work)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.allow_abbrev = False  # "--dev" after the script must reach the script, not match --devices
    parser.add_argument("--nproc", "--nproc_per_node", "--nproc-per-node", type=int, default=None,
                        help="processes on this node (default: the config's devices, else the backend's device count; "
                             "1 on cpu)")
    parser.add_argument("--nnodes", type=int, default=None, help="number of nodes (default: the config's "
                        "num_nodes, else 1)")
    parser.add_argument("--node_rank", "--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    parser.add_argument("--master_addr", "--master-addr", default="127.0.0.1",
                        help="address of node 0 (default 127.0.0.1)")
    parser.add_argument("--master_port", "--master-port", type=int, default=None,
                        help="port on node 0 (needed with --nnodes > 1; 0 = pick a free one, one node only)")
    parser.add_argument("--devices", default=None,
                        help="device indices to use, e.g. 0,2 (sets the backend's visible-devices variable)")
    parser.add_argument("--backend", default=None, help="auto|cpu|cuda|npu|mps|xla (sets XSHARD_BACKEND; default: XSHARD_BACKEND, the config's backend, auto)")
    parser.add_argument("--config", default=None, help="xshard/DeepSpeed/accelerate config file (XSHARD_CONFIG)")
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                        help="restart the whole job this many times after a failure (torchrun; default 0)")
    parser.add_argument("--join_timeout", "--join-timeout", type=int, default=None,
                        help="seconds a node waits for the others to join (several nodes; torchrun's default 600)")
    parser.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def run(args: argparse.Namespace) -> int:
    """Run `xshard launch`; returns the job's exit code."""
    opts = LaunchOptions(
        script=args.script, script_args=list(args.script_args), nproc=args.nproc, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        devices=args.devices, backend=args.backend, config=args.config, module=args.module,
        max_restarts=args.max_restarts, join_timeout=args.join_timeout,
    )
    return launch(opts)
