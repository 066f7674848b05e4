"""Show the backend xshard picks here and why, its devices, process-group backend, versions and the
variables in effect. `--check` runs a self-test on that backend (a process group, each collective, also
on views at storage offsets, a matmul and a training step per precision, fp16 with the backend's own
grad scaler, and a ZeRO-3 step) and exits non-zero if any part fails: run it on new hardware, alone or
under torchrun (`torchrun --nproc_per_node N -m xshard env --check`).

The precision line asks the device itself (CUDA and NPU answer for the device the process is bound to,
so the report binds this process's device first, as training does)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

import torch

from xshard._version import __version__
from xshard.backends import AUTO_ORDER, ENV_VAR, Backend, Selection, backend_class, cluster
from xshard.errors import XShardError

#: torchrun's variables, shown when set
LAUNCH_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def relevant_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The set variables that steer xshard or a backend: XSHARD_*, each backend's visible-devices
    and related variables, and torchrun's."""
    env = dict(os.environ if env is None else env)
    names = {k for k in env if k.startswith("XSHARD_")} | set(LAUNCH_ENV_VARS)
    for name in AUTO_ORDER:
        cls = backend_class(name)
        if cls.visible_devices_env:
            names.add(cls.visible_devices_env)
        names.update(cls.related_env_vars)
    return {k: env[k] for k in sorted(names) if k in env}


def gather(selection: Selection, backend: Backend) -> dict[str, Any]:
    """The report of `xshard env` for the chosen backend, as JSON-ready data."""
    facts = backend.describe()
    world = backend.world
    return {
        "backend": selection.name,
        "selected_by": selection.reason,
        "skipped": [{"backend": n, "reason": why} for n, why in selection.skipped],
        "device_type": facts["device_type"],
        "device": _safe(lambda: str(backend.device())),
        "device_count": facts["device_count"],
        "dist_backend": facts["dist_backend"],
        "native_avg": facts["native_avg"],
        "visible_devices_env": facts["visible_devices_env"],
        "precision": {"fp32": True, "fp16": facts["fp16"], "bf16": facts["bf16"]},
        "world": {"rank": world.rank, "world_size": world.world_size, "local_rank": world.local_rank},
        "cluster": cluster_report(),
        "versions": {
            "xshard": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            **({facts["vendor_module"] or selection.name: facts["vendor_version"]} if facts["vendor_version"] else {}),
        },
        "extra": {k: v for k, v in facts.items() if k not in _REPORTED},
        "environment": relevant_env(),
        "env_var": ENV_VAR,
    }


def cluster_report(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Which environment started this process (torchrun, Slurm, MPI, Kubeflow or none), what it gives
    and the variables it read; and, for `xshard launch` started once per node by a scheduler, the
    nodes it would fill in."""
    env = dict(os.environ if env is None else env)
    found = cluster.detect(env)
    report: dict[str, Any] = {"environment": found.environment, "summary": found.describe(), "read": found.read}
    try:
        placement = cluster.launch_placement(env)
    except XShardError as exc:  # several tasks on this node: a launcher here would be refused
        report["launch"] = f"xshard launch here would be refused: {exc}"
    else:
        if placement is not None:
            report["launch"] = (f"xshard launch here: --nnodes {placement.num_nodes} --node_rank {placement.node_rank} "
                                f"--master_addr {placement.master_addr} --master_port {placement.master_port}")
    return report


_REPORTED = {
    "backend", "device_type", "dist_backend", "visible_devices_env", "native_avg", "vendor_module",
    "vendor_version", "device_count", "bf16", "fp16",
}


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # a report must not crash on a half-working runtime
        return f"unknown ({type(exc).__name__}: {exc})"



#: the longest --timeout of the checks (a day): a longer one is a typo, and timedelta overflows on huge ones
MAX_TIMEOUT = 86400


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `xshard env`."""
    from xshard.backends import ENV_VAR, NAMES

    parser.add_argument("--backend", metavar="NAME", default=None,
                        help=f"ask for this backend, like backend= in code ({'|'.join(NAMES)}); "
                             f"it must agree with {ENV_VAR} if that is set")
    parser.add_argument("--devices", metavar="LIST", default=None,
                        help="device indices to use, e.g. 0,2: sets the backend's visible-devices variable "
                             "(CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES, ...) like the devices option")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--check", action="store_true",
                        help="run the self-test (process group, collectives, a training step per precision with the backend's "
                             "grad scaler, a ZeRO-3 step); exit 1 if any check fails")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="process-group timeout for --check (default: 60)")


def run(args: argparse.Namespace) -> int:
    """Print the report (and run the checks); 0 when everything asked for passed."""
    from xshard.backends import apply_visible_devices, select
    from xshard.cli.env_check import run_checks

    if not (0 < args.timeout <= MAX_TIMEOUT):  # also NaN
        raise XShardError(f"--timeout {args.timeout:g}: give the seconds the checks' process group waits, more than 0 "
                          f"and at most {MAX_TIMEOUT:,} (default 60)")
    selection = select(args.backend)
    applied = apply_visible_devices(selection.cls, args.devices)
    backend = selection.cls()
    report = gather(selection, backend)
    report["devices_applied"] = applied
    results = run_checks(backend, timeout=args.timeout) if args.check else None
    failed = results is not None and any(not r.passed for r in results)
    if args.json:
        if results is not None:
            report["checks"] = [r.as_dict() for r in results]
            report["checks_passed"] = not failed
        print(json.dumps(report, indent=2, default=str))
    else:
        prefix = f"[rank {backend.world.rank}] " if backend.world.use_distributed else ""
        if not prefix or backend.world.is_main_process:
            print(format_report(report))
        if results is not None:
            print(format_checks(results, prefix))
    sys.stdout.flush()
    return 1 if failed else 0


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of ``gather``'s report."""
    lines = [f"backend        {report['backend']}  (selected by {report['selected_by']})"]
    for i, skip in enumerate(report["skipped"]):
        lines.append(f"{'  skipped' if i == 0 else '':<15}{skip['backend']}: {skip['reason']}")
    lines.append(f"device         {report['device']}  ({report['device_count']} visible)")
    dist_backend = report["dist_backend"] or "none (no c10d process group)"
    avg = "native AVG" if report["native_avg"] else "AVG as SUM then divide"
    lines.append(f"dist backend   {dist_backend}  ({avg})")
    world = report["world"]
    lines.append(f"world          rank {world['rank']} of {world['world_size']}, local rank {world['local_rank']}")
    found = report["cluster"]
    read = ", ".join(f"{k}={v}" for k, v in found["read"].items()) or "nothing set"
    lines.append(f"started by     {found['summary']}  (read {read})")
    if "launch" in found:
        lines.append(f"{'':<15}{found['launch']}")
    precisions = [name for name, ok in report["precision"].items() if ok]
    lines.append(f"precision      {', '.join(precisions)}")
    lines.append("versions       " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    for key, value in report["extra"].items():
        lines.append(f"{key:<15}{value}")
    var = report["visible_devices_env"]
    if var:
        lines.append(f"device list    {var}={report['environment'].get(var, '(unset: all devices)')}")
    env = report["environment"]
    lines.append("environment    " + (", ".join(f"{k}={v}" for k, v in env.items()) if env else "(none set)"))
    return "\n".join(lines)


def format_checks(results: list, prefix: str = "") -> str:
    """One PASS/FAIL line per check and a summary line."""
    lines = [f"{prefix}{'PASS' if r.passed else 'FAIL'}  {r.name:<22}{r.detail}" for r in results]
    failed = [r.name for r in results if not r.passed]
    lines.append(f"{prefix}" + (f"FAILED: {', '.join(failed)}" if failed else f"all {len(results)} checks passed"))
    return "\n".join(lines)
