"""torch_xla's launcher (``xmp.spawn``): one process per local TPU chip, replicas found by the runtime.

`xshard launch` never imports torch_xla's runtime in its own process: once the PJRT client starts
there, ``xmp.spawn`` refuses to run ("Runtime is already initialized"). The launcher counts devices
from the environment and the PCI bus (``XLABackend.host_device_count``) and starts one child,
``xla_spawn``, which calls ``xmp.spawn`` and runs the script as ``__main__`` in each replica
process. On a TPU pod, run `xshard launch` on every host (``gcloud ... tpu-vm ssh --worker=all``):
torch_xla finds the other hosts itself, so ``--nnodes``/``--node_rank``/``--master_*`` do not apply.

``xmp.spawn`` starts either one process or one per local device; on XLA:CPU (``PJRT_DEVICE=CPU``,
for testing) ``--nproc N`` makes N virtual devices (``CPU_NUM_DEVICES``) whose replicas are threads
of one process.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from . import thread_main
from .base import Launcher, LaunchError, LaunchPlan, LaunchRequest, run_child
from .parent_death import tie_to_parent
from .preload import preload_imports

SPAWN_MODULE = f"{__package__}.xla_spawn"
#: torch_xla execution-pool threads per XLA:CPU replica (see ``cpu_replicas_env``)
POOL_THREADS_PER_REPLICA = 8


def cpu_replicas_env(world_size: int) -> dict[str, str]:
    """Environment for ``world_size`` XLA:CPU replicas, to test multi-replica code without a TPU.

    torch_xla's launcher (``xmp.spawn``) then runs one thread per virtual CPU device in one process.
    XLA:CPU ends that process when a replica waits more than a fixed 10 s in a collective for
    another (``Termination timeout for all gather``), so two settings keep the replicas' executions
    from waiting on each other's bookkeeping:

    - ``PJRT_CPU_ASYNC_CLIENT=0``: each graph runs on the torch_xla thread that launches it. With
      the asynchronous client (torch_xla's default) a launch returns before its execution has run,
      and torch_xla's lock on the device is released only when the launch's inputs are freed, which
      waits for that execution. In the aborts, one replica's execution waited at its first
      all-gather while the other replica's next graph was never launched: its thread waited for a
      device lock (XLA's execution log and a thread dump of the stuck process). Measured with
      ``xshard launch --nproc 2 examples/minimal.py`` at its default size on 2 cores: asynchronous,
      about 4 runs in 10 aborted; synchronous, none in 17 (12 of them two jobs at once).
    - ``XLA_THREAD_POOL_SIZE``: every replica's graph executions and host-to-device transfers run
      on torch_xla's one pool (by default a thread per core), and a replica's execution holds its
      thread while it waits in a collective. A pool of 2 aborted that example in every run at the
      start of its second epoch, so ``8 * world_size`` threads (at least the core count): idle
      threads cost nothing.

    Set before torch_xla starts; a value the user exported is kept (``XLALauncher.plan``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(world_size),
        "PJRT_CPU_ASYNC_CLIENT": "0",
        "XLA_THREAD_POOL_SIZE": str(max(POOL_THREADS_PER_REPLICA * world_size, os.cpu_count() or 1)),
    }


class XLALauncher(Launcher):
    """``xmp.spawn`` in one child process (tied to the launcher), the script in each replica."""

    name = "xla"

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        if request.nnodes != 1 or request.node_rank != 0 or request.master_port is not None:
            raise LaunchError(
                "--nnodes/--node_rank/--master_port do not apply to the xla launcher: run `xshard launch` on "
                "every host of the TPU slice; torch_xla finds the other hosts itself"
            )
        env = dict(request.env)
        nproc = request.nproc
        on_cpu = request.parent_env.get("PJRT_DEVICE", "").strip().upper() == "CPU"
        count = self.backend.host_device_count()
        if request.nproc_given and nproc not in (1, count):
            if on_cpu and "CPU_NUM_DEVICES" not in request.parent_env:
                env["CPU_NUM_DEVICES"] = str(nproc)  # N virtual XLA:CPU devices, one replica each
            elif on_cpu:
                raise LaunchError(
                    f"--nproc {nproc}: CPU_NUM_DEVICES={request.parent_env['CPU_NUM_DEVICES']} makes "
                    f"{count} XLA:CPU device(s), and torch_xla starts either 1 replica or one per device: "
                    f"use --nproc 1 or {count}, or change CPU_NUM_DEVICES"
                )
            else:
                devices = f"one per local device ({count})" if count is not None else "one per local device"
                raise LaunchError(
                    f"--nproc {nproc}: torch_xla starts either 1 process or {devices}; "
                    "leave --nproc out, or use --devices to choose the chips"
                )
        if on_cpu and nproc is not None and nproc > 1:
            # synchronous executions and a pool thread per replica's waiting step (see cpu_replicas_env)
            defaults = cpu_replicas_env(nproc)
            env.update({name: defaults[name] for name in ("PJRT_CPU_ASYNC_CLIENT", "XLA_THREAD_POOL_SIZE")
                        if name not in request.parent_env})
        return LaunchPlan(self, request.backend, nproc, env, list(request.command), list(request.script_args))

    def run(self, plan: LaunchPlan) -> int:
        # "1": one replica in the spawning process; "all": one process per local device (the only
        # multi-process value torch_xla accepts; its count follows the environment set above).
        replicas = "1" if plan.nproc == 1 else "all"
        return run_child([sys.executable, "-u", "-m", SPAWN_MODULE, replicas, *plan.argv, *plan.script_args])


def run_script(index: int, command: Sequence[str], spawner_pid: int, failures: str | None = None) -> None:
    """Run the user's script (``[path, args...]`` or ``["-m", module, args...]``) as ``__main__`` in
    one replica (``index``: its global ordinal); a replica process dies with the process that spawned it.

    A replica's own exception (or ``sys.exit`` with a failing code) is printed at once, with its
    replica number. In a job of several replicas (``failures``: the spawner's file for it) the
    replica then ends its process, as torchrun ends a job whose rank failed: the other replicas
    would only wait for it in their next collective, where XLA:CPU (replicas are threads of one
    process) ends the process after a fixed 10 s, and a TPU's runtime much later. Checkpoints are
    committed atomically, so this loses none. The script's third-party imports are done first, once
    per process (``preload_imports``): replica threads importing a lazy package at once can break
    each other.
    """
    if os.getpid() != spawner_pid:
        tie_to_parent(spawner_pid)
    # several replicas may be threads of this process (XLA:CPU): each runs the script in its own
    # __main__ (thread_main); runpy would swap the one sys.modules["__main__"] under the others
    threads = failures is not None
    try:
        if command[0] == "-m":
            spec = importlib.util.find_spec(command[1])
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                preload_imports(Path(spec.origin))
            sys.argv = [command[1], *command[2:]]
            if threads:
                thread_main.run_module(command[1])
            else:
                runpy.run_module(command[1], run_name="__main__", alter_sys=True)
            return
        script = command[0]
        preload_imports(Path(script))
        sys.argv = list(command)
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
        if threads:
            thread_main.run_path(script)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(f"xshard launch: replica {index} exited with {exc.code!r}", file=sys.stderr, flush=True)
            _end_the_job(failures, index, exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException:
        print(f"xshard launch: replica {index} raised:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        _end_the_job(failures, index, 1)
        raise


def _end_the_job(failures: str | None, index: int, code: int) -> None:
    """End this replica's process with ``code`` after noting ``index`` in ``failures`` (see ``run_script``);
    nothing when the job has one replica, whose exception reaches the spawner itself."""
    if failures is None:
        return
    with open(failures, "a") as f:
        f.write(f"{index} {code}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def failed_replica(failures: str) -> tuple[int, int] | None:
    """The first ``(replica, exit code)`` that ``run_script`` noted in ``failures``, or None."""
    try:
        with open(failures) as f:
            first = f.readline().split()
    except FileNotFoundError:
        return None
    return (int(first[0]), int(first[1])) if len(first) == 2 else None
