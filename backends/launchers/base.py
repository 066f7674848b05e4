"""The launcher role: how `xshard launch` starts a job's processes on one node.

The command line's generic part (options, config file, device list, process count, node checks)
ends in a ``LaunchRequest``; the backend's ``Launcher`` (``Backend.launcher()``) checks what only
its kind knows, turns the request into a ``LaunchPlan``, and runs the plan. Every kind keeps the
same promises: the job's exit code is that of the rank that failed (128 + N for a signal N), SIGINT
and SIGTERM reach the ranks, and no rank outlives the launcher (see ``parent_death``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ...errors import XShardError
from ..world import DEFAULT_MASTER_ADDR
from .parent_death import PARENT_ENV

if TYPE_CHECKING:
    # a launcher reads of its backend only what the device role declares (its name, how many devices
    # this host has): typed by that role, not by Backend, whose ``launcher()`` makes launchers
    from ..device import DeviceAPI

#: run by path as a child's first step (stdlib only): ties the child to the launcher
GUARD = Path(__file__).resolve().with_name("parent_death.py")


class LaunchError(XShardError, ValueError):
    """The launch options cannot work (the message says which option and what to use instead)."""


@dataclass(frozen=True)
class LaunchRequest:
    """What to start, after the generic checks of `xshard launch`.

    ``nproc`` is the processes per node: what the user asked for, else one per device in
    ``--devices``, else the backend's ``host_device_count()``; None when nothing could count them
    (the launcher decides, or refuses). ``env`` holds the variables set for the children so far;
    ``parent_env`` is the launcher's own environment (read-only).
    """

    backend: str
    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    nproc: int | None = 1
    nproc_given: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    max_restarts: int = 0
    join_timeout: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    parent_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def command(self) -> list[str]:
        """The script as Python's command line names it: ``[script]`` or ``["-m", module]``."""
        return ["-m", self.script] if self.module else [self.script]


@dataclass
class LaunchPlan:
    """How the job will be started: by which launcher, with what arguments and environment."""

    launcher: Launcher
    backend: str
    #: processes on this node; None: one per local device, counted by the vendor's launcher
    nproc: int | None
    #: variables set in the children's environment
    env: dict[str, str]
    #: the launcher's options followed by the script (torchrun), the child's command line up to the
    #: script's arguments (single), or the script (xla)
    argv: list[str]
    #: the script's own arguments, passed through untouched
    script_args: list[str] = field(default_factory=list)
    #: set by ``Launcher.run`` when the job failed before any script ran (the nodes never met) and the
    #: launcher said why: nothing is then to be said about what the scripts did
    failed_before_scripts: bool = False

    def describe(self) -> str:
        """One line for the log: what is about to run."""
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        command = " ".join([*self.argv, *self.script_args])
        count = "all local devices" if self.nproc is None else self.nproc
        return f"{self.launcher.name} x{count} [{self.backend}] {command}  ({extra})"


class Launcher:
    """One way of starting a job's processes. Subclasses set ``name`` and implement ``plan`` and ``run``."""

    #: shown in the log line of `xshard launch`
    name: ClassVar[str] = ""

    def __init__(self, backend: DeviceAPI) -> None:
        self.backend = backend

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """Check what only this kind of launcher knows and decide the command (starts nothing)."""
        raise NotImplementedError

    def run(self, plan: LaunchPlan) -> int:
        """Start the job and wait for it (``plan.env`` is already in os.environ); the job's exit code."""
        raise NotImplementedError

    def launch(self, plan: LaunchPlan) -> int:
        """Run ``plan`` with its variables in the environment; returns the job's exit code."""
        from ..environment import env_override

        with env_override(**plan.env):
            return self.run(plan)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend.name})"


def exit_code(code: int) -> int:
    """A process's exit code as a shell reports it (killed by signal N -> 128 + N)."""
    return 128 - code if code < 0 else code


def guarded(command: Sequence[str]) -> list[str]:
    """``command`` behind the parent-death guard (needs ``PARENT_ENV`` in its environment)."""
    return [sys.executable, str(GUARD), *command]


def run_child(command: Sequence[str]) -> int:
    """Run ``command`` as one child tied to this process: SIGINT/SIGTERM are forwarded to it (a second
    one kills it), it dies if this process is killed, and its exit code is returned."""
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    # Its own session: a Ctrl-C in the terminal reaches the child once, through the forwarding below.
    child = subprocess.Popen(guarded(command), env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        try:
            child.send_signal(signum if len(received) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    except ValueError:  # not the main thread: no forwarding, the parent-death signal still holds
        pass
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        name = signal.Signals(received[0]).name
        print(f"xshard launch: got {name}; the job stopped with exit code {exit_code(code)}", file=sys.stderr)
    return exit_code(code)
