"""``LaunchOptions``: what the user asked `xshard launch` for, as data.

The command line (``xshard.cli.launch``) fills it; the scheduler's variables (``launch_cluster``) and
the config file fill what it left out; ``plan_launch`` turns it into a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaunchOptions:
    """What the user asked `xshard launch` for (the command-line options, as data; None: not given)."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc: int | None = None
    #: accelerate's --num_processes: processes on all nodes together
    num_processes: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    devices: str | None = None
    backend: str | None = None
    config: str | None = None
    mixed_precision: str | None = None
    module: bool = False
    max_restarts: int = 0
    join_timeout: int | None = None
    #: --trainer: every transformers Trainer in the job's processes on xshard (xshard.trainer.patch)
    trainer: bool = False
