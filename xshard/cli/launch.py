"""`xshard launch`: start one training script on N processes per node, on any backend.

Examples:
  xshard launch --nproc 2 train.py --lr 3e-4
  xshard launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 train.py
  xshard launch --backend cuda --devices 0,2 --config ds_config.json train.py
  xshard launch --num_processes 8 --mixed_precision bf16 --config_file fsdp_config.yaml train.py
  xshard launch --trainer --nproc 2 --config ds_config.json -m trl.scripts.sft ARGS   # a Trainer program, unedited

The selected backend's launcher starts the processes (``Backend.launcher()``, see
``xshard.backends.launchers``): torchrun for backends with a process group, torch_xla's launcher on
XLA (one process per local chip; run it on every host of a pod), one process on single-device
backends. The job's exit code is that of the first rank that failed, and the message names that
rank. Ranks never outlive the launcher: killed in any way, even with SIGKILL, it takes them with it;
SIGINT and SIGTERM are passed on to them (exit code 128 + the signal's number).

Children get ``XSHARD_BACKEND`` (the backend chosen here, so every rank agrees), ``XSHARD_CONFIG``
(``--config``, an absolute path), ``XSHARD_MIXED_PRECISION`` (``--mixed_precision``), the backend's
visible-devices variable (``--devices``) and the variables the backend wants set (unless exported).
With ``--trainer`` (or ``XSHARD_TRAINER=1``) each process runs the program through ``python -m
xshard.trainer.patch`` and gets ``XSHARD_TRAINER=1``: every transformers Trainer it builds runs on xshard
(``xshard.trainer.switch``). A launcher inside a launcher is refused (``xshard.cli.launch_nesting``).

``accelerate launch``'s common options work as they are: ``--num_processes`` (all nodes together),
``--num_machines``, ``--machine_rank``, ``--main_process_ip``, ``--main_process_port``,
``--mixed_precision``, ``--config_file``, ``--gpu_ids``; an accelerate config file also gives the
machine rank, main process address and port and GPU ids. ``--multi_gpu`` and ``--use_fsdp`` are
accepted and change nothing: several processes are the default wherever there are several
devices, and the sharded core always runs (its stage comes from the config; 3, FSDP's FULL_SHARD,
by default).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xshard.backends import ENV_VAR, Backend, World, apply_visible_devices, parse_devices, select
from xshard.backends.launchers import LaunchError, LaunchPlan, LaunchRequest
from xshard.backends.world import DEFAULT_MASTER_ADDR
from xshard.cli.launch_cluster import with_cluster_defaults
from xshard.cli.launch_hint import program_fix
from xshard.cli.launch_nesting import refuse_launcher_program, refuse_nested_launch
from xshard.cli.launch_options import LaunchOptions
from xshard.errors import ONE_LINE_ENV

if TYPE_CHECKING:
    from xshard.config import ConfigSource

CONFIG_ENV = "XSHARD_CONFIG"
MIXED_PRECISION_ENV = "XSHARD_MIXED_PRECISION"
TRAINER_ENV = "XSHARD_TRAINER"  # xshard.trainer.switch.ENV_VAR (not imported: that imports transformers)
#: the module each process runs the program through under --trainer
TRAINER_RUNNER = "xshard.trainer.patch"
#: raises the bound on processes per node (``max_nproc``), for a node that really runs more
MAX_NPROC_ENV = "XSHARD_MAX_NPROC"

__all__ = ["LaunchError", "LaunchOptions", "LaunchPlan", "launch", "launch_options", "plan_launch", "run_plan"]


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
    """Check the options and decide how to start the job (no process is started).

    The generic part lives in ``job_request`` (config defaults, script, devices, process count, nodes); the
    backend's launcher adds what only its kind knows and the command (``Launcher.plan``).
    """
    backend, request = job_request(opts, env)
    return backend.launcher().plan(request)


def job_request(opts: LaunchOptions, env: Mapping[str, str] | None = None) -> tuple[Backend, LaunchRequest]:
    """The generic checks of `xshard launch` and what they decide: the backend, and the processes to start
    with their program and variables (``xshard.cli.dry_run`` starts one of them itself)."""
    env = os.environ if env is None else env
    refuse_nested_launch(env)
    refuse_launcher_program(opts.script, opts.module, env)
    opts = _with_config_defaults(with_cluster_defaults(opts, env), env)
    selection = select(opts.backend, env=dict(env))
    backend = selection.cls(World())
    # a process's uncaught error of a value the user set: one line, and the cause in the launcher's last line
    child_env: dict[str, str] = {ENV_VAR: backend.name, ONE_LINE_ENV: "1"}
    child_env.update({k: v for k, v in backend.default_env().items() if k not in env})

    if not opts.module and not Path(opts.script).is_file():
        raise LaunchError(f"the training script {opts.script!r} does not exist")
    if opts.config is not None:
        config_path = Path(opts.config)
        if not config_path.is_file():
            raise LaunchError(f"--config {opts.config!r}: no such file")
        child_env[CONFIG_ENV] = str(config_path.resolve())
    if opts.mixed_precision is not None:
        child_env[MIXED_PRECISION_ENV] = _mixed_precision(opts.mixed_precision)

    n_devices = None
    if opts.devices is not None:
        visible, n_devices = _visible_devices(selection.cls, opts.devices)
        child_env.update(visible)

    nproc = opts.nproc
    if nproc is None:
        count = backend.host_device_count()
        nproc = n_devices if n_devices is not None else (None if count is None else max(1, count))
        if backend.max_world_size is not None and nproc is not None:
            nproc = min(nproc, backend.max_world_size)
    if nproc is not None and nproc < 1:
        raise LaunchError(f"--nproc {nproc}: give at least 1 process per node")
    if n_devices is not None and nproc is not None and nproc > n_devices:
        raise LaunchError(f"--nproc {nproc} is more than the {n_devices} device(s) in --devices")
    if nproc is not None and opts.nproc is not None:
        _check_max_nproc(nproc, backend, env)
    nnodes, node_rank, master_addr = opts.nnodes, opts.node_rank, opts.master_addr
    assert nnodes is not None and node_rank is not None and master_addr is not None  # _with_config_defaults
    _check_counts(opts)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node_rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
    world = (nproc or 1) * nnodes
    _check_world(world, nproc, nnodes)
    if backend.max_world_size is not None and world > backend.max_world_size:
        raise LaunchError(
            f"the {backend.name} backend runs at most {backend.max_world_size} process(es), but --nproc {nproc}"
            f" x --nnodes {nnodes} asks for {world}: {backend.world_size_hint()}"
        )

    script, script_args, module = opts.script, tuple(opts.script_args), opts.module
    if trainer_switch(opts, env):
        # each process runs the program through the runner, which turns the switch on first
        script, script_args, module = TRAINER_RUNNER, (*(["-m"] if module else []), script, *script_args), True
        child_env[TRAINER_ENV] = "1"
    request = LaunchRequest(
        backend=backend.name, script=script, script_args=script_args, module=module,
        nproc=nproc, nproc_given=opts.nproc is not None, nnodes=nnodes, node_rank=node_rank,
        master_addr=master_addr, master_port=opts.master_port, max_restarts=opts.max_restarts,
        join_timeout=opts.join_timeout, env=child_env, parent_env=dict(env),
    )
    return backend, request


def trainer_switch(opts: LaunchOptions, env: Mapping[str, str]) -> bool:
    """Is the switch on: ``--trainer``, or ``XSHARD_TRAINER`` set to 1/true/yes in the launcher's environment?"""
    return opts.trainer or env.get(TRAINER_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def max_nproc(backend: Backend, env: Mapping[str, str]) -> tuple[int, str]:
    """The most processes one node may start, and why: ``XSHARD_MAX_NPROC`` when set, else the backend's bound
    (``Backend.max_processes_per_node``: one per device, or a number per CPU core)."""
    text = env.get(MAX_NPROC_ENV)
    if text is not None:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise LaunchError(f"{MAX_NPROC_ENV}={text!r}: give the most processes one node may start, a whole "
                              "number of at least 1")
        return value, f"{MAX_NPROC_ENV}={value}"
    return backend.max_processes_per_node()


def _check_max_nproc(nproc: int, backend: Backend, env: Mapping[str, str]) -> None:
    """A process count no node can run (``--nproc 100000``) is refused before anything starts."""
    limit, why = max_nproc(backend, env)
    if nproc > limit:
        raise LaunchError(f"--nproc {nproc} is more processes than this node runs (at most {limit}: {why}); give "
                          f"--nproc {limit} or fewer, or set {MAX_NPROC_ENV}={nproc} if this node really runs them")


def _check_counts(opts: LaunchOptions) -> None:
    """One line naming the fix for a count or port torchrun would reject with a traceback."""
    if opts.nnodes is not None and opts.nnodes < 1:
        raise LaunchError(f"--nnodes {opts.nnodes}: give at least 1 node")
    if opts.max_restarts is not None and opts.max_restarts < 0:
        raise LaunchError(f"--max_restarts {opts.max_restarts}: give 0 (no restart, the default) or more")
    if opts.master_port is not None and not 0 <= opts.master_port <= 65535:
        raise LaunchError(f"--master_port {opts.master_port}: a TCP port is 1..65535 (0 picks a free one on one node)")
    if opts.join_timeout is not None and opts.join_timeout < 1:
        raise LaunchError(f"--join_timeout {opts.join_timeout}: give the seconds a node waits for the others, at least 1")


def _check_world(world: int, nproc: int | None, nnodes: int) -> None:
    """A job of more processes than any cluster runs (``--nnodes 1000000``) is a typo: refused before anything
    starts, a dry run included (whose one rank would otherwise hold per-rank state for every rank of it)."""
    from xshard.config.values import MAX_PROCESSES

    if world > MAX_PROCESSES:
        raise LaunchError(f"--nproc {nproc or 1} x --nnodes {nnodes} is {world:,} processes, more than any job runs: "
                          f"give at most {MAX_PROCESSES:,} processes in all")


def _mixed_precision(value: str) -> str:
    """The canonical name of ``--mixed_precision`` (the config's spellings), or a LaunchError saying the fix."""
    from xshard.config.precision_names import (
        ACCELERATE_ORDER,
        MIXED_PRECISION_NAMES,
        not_supported_reason,
        parse_mixed_precision,
    )
    from xshard.config.values import XShardConfigError

    try:
        return parse_mixed_precision("--mixed_precision", value)
    except XShardConfigError:
        reason = not_supported_reason(value)
        if reason is not None:
            names = ", ".join(MIXED_PRECISION_NAMES[:-1]) + " or " + MIXED_PRECISION_NAMES[-1]
            raise LaunchError(f"--mixed_precision {value.strip()}: {reason}; use {names}") from None
        raise LaunchError(f"--mixed_precision {value!r}: use one of {', '.join(ACCELERATE_ORDER)}") from None


def _with_config_defaults(opts: LaunchOptions, env: Mapping[str, str]) -> LaunchOptions:
    """Fill what the command line left out: from the config file (backend, devices, num_nodes; an
    accelerate config's machine rank, main process address and port, GPU ids), then the defaults.
    accelerate's --num_processes counts all nodes together: it becomes processes per node here."""
    backend, nproc, nnodes, config_nproc = opts.backend, opts.nproc, opts.nnodes, None
    launch_keys: dict[str, Any] = {}
    if opts.config is not None and Path(opts.config).is_file():
        from xshard.config import XShardConfig, read_source

        source = read_source(opts.config, env)  # read once: the config, and whether it is accelerate's
        # a ds_config's "auto" values: from the script's command line where it spells them out; the rest
        # are filled by the script's process (the Trainer from its arguments, the Accelerator as Accelerate)
        config = XShardConfig.load(source, env=env, script_args=_script_args(opts))
        if backend is None and config.backend != "auto":
            backend = config.backend
        config_nproc = config.devices
        nnodes = config.num_nodes if nnodes is None else nnodes
        launch_keys = accelerate_launch_keys(source)
    else:
        # the job's settings from the environment (XSHARD_STAGE, XSHARD_TIMEOUT, XSHARD_CONFIG's file): a value that
        # would stop every process is refused here, in one line, before any process starts
        from xshard.config import XShardConfig

        XShardConfig.load(None, env=env, script_args=_script_args(opts))
    nnodes = 1 if nnodes is None else nnodes
    if opts.num_processes is not None:
        if nnodes < 1 or opts.num_processes % nnodes:
            raise LaunchError(
                f"--num_processes {opts.num_processes} (all machines together) is not a multiple of "
                f"--num_machines {nnodes}: every machine runs the same number of processes"
            )
        per_node = opts.num_processes // nnodes
        if nproc is not None and nproc != per_node:
            raise LaunchError(
                f"--nproc {nproc} (per machine) and --num_processes {opts.num_processes} (all {nnodes} "
                "machine(s) together) disagree: give one of them"
            )
        nproc = per_node
    nproc = config_nproc if nproc is None else nproc
    return replace(
        opts, backend=backend, nproc=nproc, nnodes=nnodes,
        node_rank=_first(opts.node_rank, launch_keys.get("machine_rank"), 0),
        master_addr=_first(opts.master_addr, launch_keys.get("main_process_ip"), DEFAULT_MASTER_ADDR),
        master_port=_first(opts.master_port, launch_keys.get("main_process_port")),
        devices=_first(opts.devices, launch_keys.get("gpu_ids")),
    )


def _script_args(opts: LaunchOptions) -> Any:
    """The Trainer's arguments the script's command line spells out: a ds_config's "auto" values are filled from
    them at launch; the rest are filled by the script's process (the Trainer, or the Accelerator as Accelerate)."""
    from xshard.config.script_argv import launch_script_args

    return launch_script_args(opts.script_args)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def accelerate_launch_keys(source: ConfigSource) -> dict[str, Any]:
    """The launch settings of an accelerate config (machine rank, main process address and port, GPU ids;
    "all" GPUs is no restriction), from its `xshard.config.ConfigSource`; empty for any other kind of config."""
    from xshard.config import ConfigKind
    from xshard.config.fsdp import ACCELERATE_LAUNCH_KEYS

    if source.kind is not ConfigKind.ACCELERATE or source.data is None:
        return {}
    data, path = source.data, source.name
    found: dict[str, Any] = {}
    for key in sorted(ACCELERATE_LAUNCH_KEYS):  # each one fills the option of the same name
        value = data.get(key)
        if value is None or value == "" or (key == "gpu_ids" and str(value).strip().lower() == "all"):
            continue
        if key in ("machine_rank", "main_process_port"):
            try:
                found[key] = int(value)
            except (TypeError, ValueError):
                raise LaunchError(f"{path}: {key}={value!r} is not a whole number (it sets --{key})") from None
        else:
            found[key] = str(value)
    return found


def run_plan(plan: LaunchPlan) -> int:
    """Start the job and wait for it; returns the job's exit code (a failed rank's own code)."""
    return plan.launcher.launch(plan)


def launch(opts: LaunchOptions) -> int:
    """Plan and run: the whole of `xshard launch`."""
    from xshard.backends.launchers.temp_dirs import job_temp_dir, sweep_stale
    from xshard.runtime.launch_marker import MARKER_ENV, accelerator_was_built, failed_in_xshard
    from xshard.runtime.rank_logging import get_logger, setup_logging

    setup_logging()
    plan = plan_launch(opts)
    log = get_logger("xshard.launch")
    for stale in sweep_stale():  # what launchers killed with SIGKILL left behind
        log.info("removed %s, left by a launcher that was killed", stale)
    log.info("launching: %s", plan.describe())
    flights = flight_records_dir(plan.env, os.environ)
    with job_temp_dir("launch") as markers:
        plan.env[MARKER_ENV] = markers
        code = run_plan(plan)
        written = sorted(flights.glob("rank*.json")) if flights.is_dir() else []
        if written:  # a rank failed, hung or was asked: where each rank's last collectives are
            print(f"xshard launch: the last collectives of {len(written)} rank(s) of this node are in {flights} "
                  "(rank<R>.json: each collective's number, kind, group, bytes and times; in_flight: the ones it "
                  "waited in)", file=sys.stderr)
        if not accelerator_was_built(markers) and not plan.failed_before_scripts:
            fix = program_fix(opts.script, opts.module, switch=trainer_switch(opts, os.environ))
            print(not_on_xshard_message(plan.env, os.environ, failed=code != 0, fix=fix,
                                        xshard_frame=failed_in_xshard(markers)), file=sys.stderr)
    return code


def flight_records_dir(child_env: dict[str, str], env: Mapping[str, str]) -> Path:
    """The folder the job's ranks write their flight records to (``backends/diagnostics/flight_recorder.py``): the user's
    ``XSHARD_FLIGHT_DIR``, else one of this launch's own in the temporary directory, set for the children."""
    from xshard.backends.diagnostics.flight_recorder import DIR_ENV

    if env.get(DIR_ENV):
        return Path(env[DIR_ENV])
    folder = Path(tempfile.gettempdir()) / f"xshard-flight-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    child_env[DIR_ENV] = str(folder)
    return folder


def not_on_xshard_message(child_env: Mapping[str, str], env: Mapping[str, str], failed: bool = False,
                          fix: str | None = None, xshard_frame: str | None = None) -> str:
    """The one line for a job whose processes never built an xshard Accelerator: what ran instead, the fix,
    and the settings that therefore had no effect. ``failed``: the job failed, and the line says that
    the failure came before xshard had any part in it (a stock script's own crash, or an error before
    the script built its Accelerator). ``fix``: the change that fits the program
    (``xshard.cli.launch_hint.program_fix``); by default the one for a program it could not read.
    ``xshard_frame``: a process failed with xshard's code in its traceback (``launch_marker.failed_in_xshard``):
    then the line names that frame, never saying that xshard had no part in the failure."""
    from xshard.config.schema import ENV_PREFIX, FIELD_NAMES

    if failed and xshard_frame is not None:
        return (f"xshard launch: the job failed in xshard's code ({xshard_frame}) before any process built an "
                "xshard Accelerator; the traceback above says why")
    unused = []
    if CONFIG_ENV in child_env:
        unused.append(f"--config {child_env[CONFIG_ENV]}")
    if MIXED_PRECISION_ENV in child_env:
        unused.append(f"--mixed_precision {child_env[MIXED_PRECISION_ENV]}")
    # XSHARD_BACKEND chose the launcher and the process count, so it did act; the other fields are the
    # Accelerator's to read
    names = [ENV_PREFIX + name.upper() for name in FIELD_NAMES if name != "backend"] + [CONFIG_ENV]
    unused += [f"{name}={env[name]}" for name in names if name in env and name not in child_env]
    fix = program_fix("", module=True) if fix is None else fix
    if failed:
        message = ("xshard launch: no process of this job built an xshard Accelerator before it failed, so xshard "
                   "had no part in the failure; if the script uses stock Accelerate or the stock Trainer, it ran "
                   f"without xshard: {fix}")
    else:
        message = ("xshard launch: no process of this job built an xshard Accelerator, so the script ran without "
                   f"xshard (stock Accelerate or the stock Trainer); {fix}")
    if unused:
        message += f"; these settings had no effect: {', '.join(unused)}"
    return message


# ---------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `xshard launch` (underscore and dash spellings both work; accelerate's names too)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.allow_abbrev = False  # "--dev" after the script must reach the script, not match --devices
    parser.add_argument("--nproc", "--nproc_per_node", "--nproc-per-node", type=int, default=None,
                        help="processes on this node (default: the config's devices, else the backend's device count; "
                             "1 on cpu)")
    parser.add_argument("--num_processes", "--num-processes", type=int, default=None,
                        help="accelerate's spelling: processes on all nodes together (--nproc = this / --nnodes)")
    parser.add_argument("--nnodes", "--num_machines", "--num-machines", type=int, default=None,
                        help="number of nodes (default: the config's num_nodes, else 1)")
    parser.add_argument("--node_rank", "--node-rank", "--machine_rank", "--machine-rank", type=int, default=None,
                        help="this node's index, 0..nnodes-1 (default 0)")
    parser.add_argument("--master_addr", "--master-addr", "--main_process_ip", "--main-process-ip", default=None,
                        help="address of node 0 (default 127.0.0.1)")
    parser.add_argument("--master_port", "--master-port", "--main_process_port", "--main-process-port", type=int,
                        default=None, help="port on node 0 (needed with --nnodes > 1; 0 = pick a free one, one node only)")
    parser.add_argument("--devices", "--gpu_ids", "--gpu-ids", default=None,
                        help="device indices to use, e.g. 0,2 (sets the backend's visible-devices variable; "
                             "'all' for every device)")
    parser.add_argument("--backend", default=None,
                        help="a backend name or auto (sets XSHARD_BACKEND; default: XSHARD_BACKEND, the config's "
                             "backend, auto); `xshard env` lists them")
    parser.add_argument("--config", "--config_file", "--config-file", default=None,
                        help="xshard/DeepSpeed/accelerate config file (XSHARD_CONFIG)")
    parser.add_argument("--mixed_precision", "--mixed-precision", default=None, metavar="{no,fp16,bf16}",
                        help="compute dtype for the job (XSHARD_MIXED_PRECISION; the script's own argument wins)")
    parser.add_argument("--multi_gpu", "--multi-gpu", action="store_true",
                        help="accepted from accelerate launch; changes nothing (several devices get several "
                             "processes by default; --num_processes sets the count)")
    parser.add_argument("--use_fsdp", "--use-fsdp", action="store_true",
                        help="accepted from accelerate launch; changes nothing (xshard always shards; the stage "
                             "comes from the config, 3 = FSDP FULL_SHARD by default)")
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                        help="restart the whole job this many times after a failure (torchrun; default 0)")
    parser.add_argument("--join_timeout", "--join-timeout", type=int, default=None,
                        help="seconds a node waits for the others to join (several nodes; torchrun's default 600)")
    parser.add_argument("--trainer", "--patch_trainer", "--patch-trainer", action="store_true",
                        help="run every transformers Trainer (and subclass: TRL's, a framework's) the program builds on "
                             "xshard, with no edit to the program (XSHARD_TRAINER=1 does the same; plain torchrun: "
                             "torchrun ... -m xshard.trainer.patch script.py)")
    parser.add_argument("--dry-run", "--dry_run", action="store_true",
                        help="run the script on this machine as ONE rank of the job these options describe (torch's "
                             "fake process group), report its plan, state, collectives and checkpoint, and refuse "
                             "what cannot start at that size (xshard.cli.dry_run)")
    parser.add_argument("--dry_run_rank", "--dry-run-rank", type=int, default=0, help="the rank a dry run plays (0)")
    parser.add_argument("--dry_run_steps", "--dry-run-steps", type=int, default=2,
                        help="optimizer steps a dry run takes; the last one's collectives are reported (2)")
    parser.add_argument("--device-memory", "--device_memory", default=None, metavar="SIZE",
                        help="the target device's memory (64GB, 64GiB, as xshard estimate reads it): a dry run refuses "
                             "a job whose model state and gathered units need more than a run may use of it")
    parser.add_argument("--dry_run_report", "--dry-run-report", default=None, metavar="PATH",
                        help="keep a dry run's report there, as JSON")
    parser.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The parsed command line as ``LaunchOptions`` ("--gpu_ids all" is no restriction)."""
    devices = None if args.devices is not None and args.devices.strip().lower() == "all" else args.devices
    return LaunchOptions(
        script=args.script, script_args=list(args.script_args), nproc=args.nproc,
        num_processes=args.num_processes, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, devices=devices, backend=args.backend,
        config=args.config, mixed_precision=args.mixed_precision, module=args.module,
        max_restarts=args.max_restarts, join_timeout=args.join_timeout, trainer=args.trainer,
    )


def launch_options(argv: Sequence[str]) -> LaunchOptions:
    """``LaunchOptions`` from a command line (the arguments after ``xshard launch``), as `xshard` reads it."""
    parser = argparse.ArgumentParser(prog="xshard launch")
    add_arguments(parser)
    args, rest = parser.parse_known_args(list(argv))
    args.script_args = [*args.script_args, *rest]
    return options_from_args(args)


def run(args: argparse.Namespace) -> int:
    """Run `xshard launch` (or its dry run); returns the job's exit code."""
    if args.dry_run:
        from xshard.backends import DRY_RUN
        from xshard.backends.devices.dry_run_backend import register
        from xshard.cli.dry_run import DryRunOptions, dry_run
        from xshard.estimate import EstimateError, parse_memory

        try:
            memory = None if args.device_memory is None else parse_memory(args.device_memory)
        except EstimateError as exc:
            raise LaunchError(f"--device-memory: {exc}") from None
        register()  # the dry run's backend, in this process too: the launch's checks select it
        _, request = job_request(replace(options_from_args(args), backend=DRY_RUN))
        return dry_run(request, DryRunOptions(rank=args.dry_run_rank, steps=args.dry_run_steps, device_memory=memory,
                                              report=args.dry_run_report))
    return launch(options_from_args(args))
