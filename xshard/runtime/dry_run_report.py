"""What a dry run reports (``xshard launch --dry-run``): the plan, the state and the collectives of ONE rank of
the target job, measured in this process over torch's fake process group (``backends/devices/dry_run_backend.py``).

The job's ``DryRunReport`` watches its optimizer steps (``JobState.step_observers``). At the end of the
run's last step (``XSHARD_DRY_RUN_STEPS``, 2 by default) it writes the report to ``XSHARD_DRY_RUN`` and ends
the script (``SystemExit(0)``: the launcher reads the report and says the rest). A script that ends before
that (no optimizer step, fewer steps) gets its report at exit, with what it reached.

Every figure is measured from the live objects, none from formulas:

- per model: its units (the gathered bytes of each, padding to the world's shards included), the plan's
  stage, shard group and replicas, and ``state_bytes`` (``xshard.sharding.stats``) at the step's end;
- the collectives of the last step (calls and bytes per kind, ``_inter`` for the hybrid replicas'
  all-reduce), counted as ``backends/collectives/accounting.py`` counts them;
- the most memory the model state can need on the device: the state held at a step's end plus, at stage
  3, the units gathered for compute (the root unit, which stays gathered through forward and backward,
  and the most other units gathered at once, the engine's measured ``peak_in_flight``, at the largest
  one's bytes).
  Activations are not in it (the fake process group runs on the CPU, whose memory says nothing of the
  target device's); the report says so.
"""

from __future__ import annotations

import atexit
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..backends.devices.dry_run_settings import DryRunSettings
    from .job import JobState

#: what a dry run cannot tell, said in every report
NOT_CHECKED = (
    "values: the fake process group moves no data, so losses and weights are meaningless",
    "activation memory: only the model state and its gathered units are counted",
    "the network: collective bytes are counted, their time is not measured",
    "other ranks: only this rank ran (ranks past a tensor's last row hold less of it)",
    "checkpoint writes: nothing is saved (the files this rank would write are listed, with their bytes)",
)


class DryRunFinished(SystemExit):
    """The dry run took its steps and wrote its report: the script ends here, successfully."""


class DryRunReport:
    """Watches a job's optimizer steps on the dry run's backend and writes its report (module docstring)."""

    def __init__(self, job: JobState, settings: DryRunSettings,
                 checkpoint_files: Callable[[JobState], dict[str, int]] | None = None) -> None:
        self.job = job
        self.settings = settings
        #: the files a job's rank would write in a save, name -> bytes: ``checkpoint.save_load.planned_files``,
        #: handed in by the one who builds the report (the job machinery here imports no checkpoint code: the
        #: checkpoint package imports this one's logging, and the packages form no circle)
        self.checkpoint_files = checkpoint_files
        self.path = Path(settings.report_path)
        self._previous: dict[str, dict[str, int]] | None = None
        self._last_step: dict[str, dict[str, int]] | None = None
        self._written = False
        atexit.register(self._at_exit)

    def __call__(self, job: JobState) -> None:
        """An optimizer step finished: note its collectives; after the last one, report and end the script."""
        counted = job.backend.collectives.counter.snapshot()
        if self._previous is not None:
            self._last_step = _difference(counted, self._previous)
        self._previous = counted
        if job.step >= self.settings.steps:
            self.write()
            raise DryRunFinished(0)

    def write(self) -> dict[str, Any]:
        """Write the report (JSON) where the launcher reads it; returns it."""
        report = self.report()
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(json.dumps(report, indent=1))
        os.replace(part, self.path)
        self._written = True
        return report

    def report(self) -> dict[str, Any]:
        """The report as a dict (see the module docstring)."""
        job, world = self.job, self.job.backend.world
        models = [_model_report(model) for model in job.models]
        state = sum(m["state_bytes"]["device"] for m in models)
        peak = state + sum(m["peak_gathered_bytes"] for m in models)
        memory = self.settings.device_memory
        return {
            "world_size": world.world_size, "rank": world.rank, "local_rank": world.local_rank,
            "local_world_size": world.local_world_size, "steps": job.step,
            "gradient_accumulation_steps": job.gradient_accumulation_steps,
            "mixed_precision": str(job.config.mixed_precision),
            "models": models,
            "optimizers": len(job.optimizers),
            "collectives_per_step": self._last_step,
            "device_state_bytes": state,
            "peak_model_bytes": peak,
            "checkpoint_files": self.checkpoint_files(job) if self.checkpoint_files is not None else None,
            "checkpoint_state_type": str(job.config.state_dict_type),
            "device_memory": memory,
            "not_checked": list(NOT_CHECKED),
        }

    def _at_exit(self) -> None:
        if not self._written:  # the script ended before the last step: report what it reached
            self.write()


def _model_report(model: Any) -> dict[str, Any]:
    stats = model.stats()
    units = [{"name": unit.name, "bytes": sum(sp.full_bytes for sp in unit.params),
              "shard_bytes": sum(sp.padded.numel() * sp.padded.element_size() for sp in unit.params)}
             for unit in model.units]
    # stage 3 gathers units for compute: the root unit for the whole forward and backward, the others one at
    # a time plus the most prefetched at once (the engine's measured peak); stages 0-2 keep full copies, which
    # ``state_bytes`` already counts
    root = units[0]["bytes"] if units and model.units[0].is_root else 0
    others = [u["bytes"] for u, unit in zip(units, model.units, strict=True) if not unit.is_root]
    gathered = root + max(1, stats["gathers"]["peak_in_flight"]) * max(others, default=0) if stats["stage"] == 3 else 0
    held = sum(p.numel() for p in dict.fromkeys(model.module.parameters()))  # shards, or whole at stage 0
    parameters = sum(sp.layout.numel for unit in model.units for sp in unit.params) if model.units else held
    return {
        "class": type(model.module).__name__,
        "plan": model.plan.describe(),
        "stage": stats["stage"], "shard_group_size": stats["shard_group_size"], "replicas": stats["replicas"],
        "parameters": parameters, "parameters_on_this_rank": held,
        "units": units,
        "largest_unit_bytes": max((u["bytes"] for u in units), default=0),
        "peak_gathered_units": stats["gathers"]["peak_in_flight"],
        "peak_gathered_bytes": gathered,
        "state_bytes": stats["state_bytes"],
    }


def _difference(now: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The calls and bytes counted between two ``CommCounter`` snapshots, per kind."""
    return {part: {kind: count - before[part].get(kind, 0) for kind, count in now[part].items()
                   if count - before[part].get(kind, 0)} for part in ("calls", "bytes")}
