"""One process: for a backend whose job is a single process on a single device (MPS)."""

from __future__ import annotations

import sys

from .base import Launcher, LaunchError, LaunchPlan, LaunchRequest, run_child


class SingleLauncher(Launcher):
    """The script in one child process (``python -u script ...``); a larger world is refused earlier
    by the backend's ``max_world_size``."""

    name = "single"

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        if request.nnodes != 1:
            raise LaunchError(f"the {request.backend} backend runs one process on one machine: drop --nnodes")
        argv = [sys.executable, "-u", *request.command]
        return LaunchPlan(self, request.backend, 1, dict(request.env), argv, list(request.script_args))

    def run(self, plan: LaunchPlan) -> int:
        return run_child([*plan.argv, *plan.script_args])
