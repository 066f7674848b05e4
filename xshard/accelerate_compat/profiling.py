"""``accelerator.profile()``: Accelerate's profiler context, over ``torch.profiler.profile``.

A ``ProfileKwargs`` (xshard's, ``xshard.utils``, or Accelerate's own: its fields are read by name) says
what to record. As in Accelerate 1.15:

- ``activities`` are names (``"cpu"``, ``"cuda"``); None leaves torch's default;
- ``schedule_option`` is the keywords of ``torch.profiler.schedule`` (``wait``, ``warmup``, ``active``,
  ``repeat``, ``skip_first``): the script calls ``prof.step()`` once per step, every process on the same
  schedule;
- ``output_trace_dir``: after the block each process writes its Chrome trace there as
  ``profile_<process_index>.json``, then every process waits for the others.

Which activities a job can record depends on its device family, so the names come from the backend's
``device_type`` (CPU always, CUDA on the cuda backend), never from probing ``torch.cuda``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: the trace file of each process in ``output_trace_dir`` (Accelerate's ``PROFILE_PATTERN_NAME``)
TRACE_FILE = "profile_{suffix}.json"

#: the keywords ``torch.profiler.schedule`` takes (a ``schedule_option`` key outside them is an error)
SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")


def profiler_activities(device_type: str) -> dict[str, torch.profiler.ProfilerActivity]:
    """The activity names a job on ``device_type`` can record, and torch's activity for each."""
    activities = {"cpu": torch.profiler.ProfilerActivity.CPU}
    own = getattr(torch.profiler.ProfilerActivity, device_type.upper(), None)  # CUDA, XPU, MTIA ... where torch has it
    if own is not None:
        activities[device_type] = own
    return activities


def build_profiler(handler: Any, device_type: str) -> torch.profiler.profile:
    """The ``torch.profiler.profile`` a ``ProfileKwargs`` describes, on a job of ``device_type``."""
    activities = None
    names = getattr(handler, "activities", None)
    if names is not None:
        known = profiler_activities(device_type)
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(f"ProfileKwargs(activities={list(names)!r}): {unknown[0]!r} cannot be recorded on the "
                             f"{device_type} backend; use {sorted(known)}")
        activities = [known[name] for name in names]
    schedule = None
    option = getattr(handler, "schedule_option", None)
    if option is not None:
        wrong = sorted(set(option) - set(SCHEDULE_KEYS))
        if wrong:
            raise ValueError(f"ProfileKwargs(schedule_option=...): {wrong[0]!r} is not a torch.profiler.schedule "
                             f"keyword; use {', '.join(SCHEDULE_KEYS)}")
        schedule = torch.profiler.schedule(**option)
    return torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=getattr(handler, "on_trace_ready", None),
        record_shapes=bool(getattr(handler, "record_shapes", False)),
        profile_memory=bool(getattr(handler, "profile_memory", False)),
        with_stack=bool(getattr(handler, "with_stack", False)), with_flops=bool(getattr(handler, "with_flops", False)),
        with_modules=bool(getattr(handler, "with_modules", False)),
    )


@contextlib.contextmanager
def profile(handler: Any, device_type: str, process_index: int,
            wait_for_everyone: Callable[[], None]) -> Iterator[torch.profiler.profile]:
    """Profile the block; then write this process's trace to ``handler.output_trace_dir`` (when set) and wait
    for every process, as Accelerate's ``Accelerator.profile`` does."""
    with build_profiler(handler, device_type) as profiler:
        yield profiler
    folder = getattr(handler, "output_trace_dir", None)
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(folder, TRACE_FILE.format(suffix=process_index)))
    wait_for_everyone()
