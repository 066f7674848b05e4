"""`xshard launch --dry-run`: the script as ONE rank of the target job, on this machine, before the cluster.

    xshard launch --dry-run --nnodes 128 --nproc 8 train.py --its args
    xshard launch --dry-run --nnodes 16 --nproc 8 --device-memory 64GB --config ds_config.json train.py

runs ``train.py`` once, as rank 0 (``--dry_run_rank``) of 1,024, on this host's CPU over torch's fake process
group (``backends/devices/dry_run_backend.py``), through ``prepare`` and ``--dry_run_steps`` optimizer steps (2). It prints the
sharding plan (units and the bytes each gathers, hybrid groups), the state this rank holds, the collectives
of one step (calls and bytes per kind) and the files a checkpoint would have this rank write, and exits 1 when the job cannot
start at that size: the script failed there (a hybrid group that does not divide the world, say: its error
is above the summary), or the model state and its gathered units need more of ``--device-memory`` than a run
may use (``xshard estimate``'s rule: 90%).
It says what it could not check (``xshard.runtime.dry_run_report.NOT_CHECKED``). ``--dry_run_report PATH`` keeps
the report as JSON.

Everything else is a real launch's (``xshard.cli.launch.job_request``): the config, ``--mixed_precision``,
``--trainer``, the world's checks. The model is built as the script builds it, so a model too large for this
host must be built on the meta device by the script (``xshard.pretrained.from_pretrained_sharded`` does).

``python -m xshard.cli.dry_run [-m] PROGRAM [ARGS]`` is the runner each dry run's process goes through: it
registers the ``dry_run`` backend in that process, then runs the program as Python would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xshard.backends import DRY_RUN, ENV_VAR
from xshard.backends.devices.dry_run_backend import register
from xshard.backends.devices.dry_run_settings import DEVICE_MEMORY_ENV, REPORT_ENV, STEPS_ENV
from xshard.backends.launchers import LaunchError, LaunchRequest
from xshard.backends.world import DEFAULT_MASTER_ADDR
from xshard.estimate import USABLE_FRACTION

RUNNER = "xshard.cli.dry_run"


@dataclass
class DryRunOptions:
    """The dry run's own options: the rank it plays, its optimizer steps, the target device's memory in bytes
    (``xshard.estimate.parse_memory`` reads ``--device-memory``), where to keep the report (None: a temporary file)."""

    rank: int = 0
    steps: int = 2
    device_memory: int | None = None
    report: str | None = None


def dry_run(request: LaunchRequest, dry: DryRunOptions, env: Mapping[str, str] | None = None) -> int:
    """Run the dry run of the job ``request`` describes (``xshard.cli.launch.job_request``, its backend
    ``dry_run``) and print its summary; returns 0, or 1 when the job cannot start at that size."""
    env = dict(os.environ if env is None else env)
    nproc = request.nproc or 1
    world = nproc * request.nnodes
    if not 0 <= dry.rank < world:
        raise LaunchError(f"--dry_run_rank {dry.rank} must be in 0..{world - 1} (--nproc {nproc} x --nnodes "
                          f"{request.nnodes})")
    if dry.steps < 1:
        raise LaunchError(f"--dry_run_steps {dry.steps}: give at least 1 optimizer step")
    with tempfile.TemporaryDirectory(prefix="xshard-dry-run-") as folder:
        report_path = Path(dry.report).resolve() if dry.report else Path(folder) / "report.json"
        child = {**env, **request.env, ENV_VAR: DRY_RUN, "RANK": str(dry.rank), "LOCAL_RANK": str(dry.rank % nproc),
                 "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(dry.rank // nproc),
                 "MASTER_ADDR": DEFAULT_MASTER_ADDR, "MASTER_PORT": "29500", "XSHARD_MONITOR": "0",
                 REPORT_ENV: str(report_path), STEPS_ENV: str(dry.steps)}
        if dry.device_memory is not None:
            child[DEVICE_MEMORY_ENV] = str(dry.device_memory)
        command = [sys.executable, "-m", RUNNER, *request.command, *request.script_args]
        print(f"xshard dry run: rank {dry.rank} of {world} ({request.nnodes} node(s) x {nproc}) on this host's CPU, "
              "over torch's fake process group", file=sys.stderr)
        code = subprocess.call(command, env=child)
        if code != 0 or not report_path.is_file():
            report_path.unlink(missing_ok=True)  # what the script reached before it failed is no report of the job
            print(f"xshard launch --dry-run: the script failed as rank {dry.rank} of {world} (exit code {code}): this "
                  "job cannot start at that size; its error is above", file=sys.stderr)
            return code or 1
        report = json.loads(report_path.read_text())
    memory = report["device_memory"]
    report["fits"] = None if memory is None else report["peak_model_bytes"] <= USABLE_FRACTION * memory
    if dry.report:  # the kept report says it too
        Path(dry.report).write_text(json.dumps(report, indent=1))
    print(summary(report), file=sys.stderr)
    if report["fits"] is False:
        print(f"xshard launch --dry-run: the model state needs {_size(report['peak_model_bytes'])} per device at "
              f"{world} ranks, more than a run may use of the {_size(report['device_memory'])} of --device-memory "
              f"({USABLE_FRACTION:.0%}, as xshard estimate counts): shard more "
              "(stage 3, a larger shard group), offload (offload_optimizer, offload_params) or wrap smaller units",
              file=sys.stderr)
        return 1
    return 0


def summary(report: dict[str, Any]) -> str:
    """The dry run's report as the lines it prints."""
    lines = [f"ran {report['steps']} optimizer step(s) as rank {report['rank']} of {report['world_size']}"]
    for model in report["models"]:
        state = model["state_bytes"]
        lines.append(f"model {model['class']}: {model['parameters']:,} parameters; {model['plan']}")
        if model["units"]:
            lines.append(f"  {len(model['units'])} unit(s), the largest gathers {_size(model['largest_unit_bytes'])}"
                         + (f"; gathered for compute at most {_size(model['peak_gathered_bytes'])}"
                            if model["peak_gathered_bytes"] else ""))
        lines.append(f"  this rank holds: parameters {_size(state['params'])}, gradients {_size(state['grads'])}, "
                     f"optimizer state {_size(state['optimizer'])} ({_size(state['device'])} on the device, "
                     f"{_size(state['offloaded'])} offloaded)")
    step = report["collectives_per_step"]
    if step is None:
        lines.append("collectives of one step: not measured (give --dry_run_steps 2 or more)")
    else:
        kinds = ", ".join(f"{kind} {step['calls'][kind]} call(s) {_size(step['bytes'].get(kind, 0))}"
                          for kind in sorted(step["calls"])) or "none"
        lines.append(f"collectives of one step on this rank: {kinds}")
    lines.append(f"model memory on the device at its peak: {_size(report['peak_model_bytes'])} (the state and the "
                 "units gathered at once; activations not counted)"
                 + ("" if report["device_memory"] is None else
                    f"; {'fits' if report['fits'] else 'does NOT fit'} in {_size(report['device_memory'])} "
                    f"(a run may use {USABLE_FRACTION:.0%})"))
    files = report["checkpoint_files"] or {}
    lines.append(f"a checkpoint ({report['checkpoint_state_type']}): this rank writes {len(files)} file(s), "
                 f"{_size(sum(files.values()))}: " + ", ".join(f"{name} {_size(n)}" for name, n in files.items()))
    lines.append("not checked: " + "; ".join(report["not_checked"]))
    return "\n".join(lines)


def _size(n: float) -> str:
    """Bytes in decimal units, as device memory is sold (GB = 1e9 bytes, as --device-memory reads 64GB)."""
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"


def main(argv: list[str] | None = None) -> None:
    """The runner of the dry run's process: register the backend, then run the program as Python would."""
    from xshard.runtime.program import run_program

    register()
    run_program(list(sys.argv[1:] if argv is None else argv), RUNNER)


if __name__ == "__main__":
    main()
