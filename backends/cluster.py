"""Cluster environments: where this process sits in a job, read from whatever started it.

One process of a job learns its rank, the world size, its local rank and node-mates and the
rendezvous address from the variables its starter set. ``detect`` reads, in this order:

- torchrun (``TORCHELASTIC_RUN_ID``/``GROUP_RANK`` with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``), which `xshard launch` uses; the same variables without torchrun's marks
  (set by hand, or by a Kubernetes operator: a Kubeflow PyTorchJob pod has ``RANK``/``WORLD_SIZE``
  and no ``LOCAL_RANK``: one process per pod, local rank 0, as Lightning's KubeflowEnvironment reads it);
- a Slurm job step (``srun``: ``SLURM_STEP_NUM_TASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_NODEID``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_STEP_NODELIST``, ``SLURM_JOB_ID``). As in
  Lightning's SLURMEnvironment the rendezvous is the first host of the node list, on port
  15000 + the job id's last four digits; ``MASTER_ADDR``/``MASTER_PORT`` override both. Only an
  ``srun`` step counts (its ``SLURM_STEP_*`` variables): a batch script itself runs as one process,
  so `python train.py` typed into an sbatch script is not mistaken for one task of many;
- MPI launchers: Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``)
  and MPICH / Intel MPI's Hydra (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``).
  MPI names no rendezvous host: one node uses 127.0.0.1; several need ``MASTER_ADDR`` passed to every
  rank (``mpirun -x MASTER_ADDR=<host of rank 0>``), which the error says.

A script started once per device by ``srun`` or ``mpirun`` (no torchrun) therefore runs as it does
under `xshard launch`. ``launch_placement`` serves `xshard launch` itself when a scheduler started it
once per node (``srun --ntasks-per-node=1 xshard launch ...``): the nodes, this node's rank and the
rendezvous come from the scheduler. A torchrun started by each of several tasks on one node (``srun
--ntasks-per-node=8 torchrun ...``) cannot make one world and is refused, naming the two fixes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ..errors import WorldEnvironmentError
from .world import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, World

__all__ = ["detect", "first_host", "launch_placement", "tasks_per_node"]

#: Slurm's conventional rendezvous port: this base + the last four digits of the job id (Lightning's rule)
SLURM_PORT_BASE = 15000
_TORCHRUN_MARKS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK")
_KUBERNETES_MARKS = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_PORT")


class _Reader:
    """Reads integers and strings from an environment and remembers what it read."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.read: dict[str, str] = {}

    def has(self, *names: str) -> bool:
        return all(self.env.get(n, "") != "" for n in names)

    def text(self, name: str) -> str | None:
        value = self.env.get(name)
        if value is None or value == "":
            return None
        self.read[name] = value
        return value

    def int(self, name: str, default: int | None = None) -> int:
        raw = self.text(name)
        if raw is None:
            if default is None:
                raise WorldEnvironmentError(f"environment variable {name} is not set: check the launcher's environment")
            return default
        try:
            return int(raw)
        except ValueError:
            raise WorldEnvironmentError(
                f"environment variable {name}={raw!r} is not an integer: check the launcher's environment"
            ) from None


def detect(env: Mapping[str, str] | None = None) -> World:
    """Where this process sits, read from the environment (``os.environ`` by default) that whatever started it
    set (see the module's docstring for the order and the variables); one process when none is set."""
    r = _Reader(os.environ if env is None else env)
    scheduler = _scheduler(r)
    if r.has("RANK") or r.has("WORLD_SIZE") or r.has("LOCAL_RANK"):
        found = _torchrun(r)
        if scheduler is not None and found.environment == "torchrun" and scheduler.local_world_size > 1:
            raise WorldEnvironmentError(_torchrun_inside_tasks(scheduler))
        return _checked(found)
    if scheduler is not None:
        return _checked(scheduler)
    return World()


def launch_placement(env: Mapping[str, str]) -> World | None:
    """For `xshard launch`: the scheduler that started it once per node (nodes, node rank, rendezvous), or None.

    None when no scheduler started several tasks. A scheduler that started several tasks on this
    node, each of which would start its own processes, is refused naming the fixes.
    """
    r = _Reader(env)
    scheduler = _scheduler(r)
    if scheduler is None:
        return _kubeflow_pod(r)
    if scheduler.world_size == 1:
        return None
    if scheduler.local_world_size > 1:
        raise WorldEnvironmentError(_launcher_inside_tasks(scheduler))
    # one launcher per node: the tasks are the nodes
    return _checked(World(
        environment=scheduler.environment, rank=scheduler.rank, world_size=scheduler.world_size, node_rank=scheduler.rank,
        num_nodes=scheduler.world_size, master_addr=scheduler.master_addr, master_port=scheduler.master_port,
        read=scheduler.read, sources=scheduler.sources))


# ---------------------------------------------------------------------------- the environments


def _torchrun(r: _Reader) -> World:
    world_size = r.int("WORLD_SIZE", 1)
    rank = r.int("RANK", 0)
    marked = any(r.has(m) for m in _TORCHRUN_MARKS)
    if not marked and not r.has("LOCAL_RANK") and any(r.has(m) for m in _KUBERNETES_MARKS):
        name, local_rank, local_world = "kubeflow", 0, 1  # one process per pod
    else:
        name = "torchrun" if marked else "env"
        local_rank = r.int("LOCAL_RANK", rank)
        local_world = r.int("LOCAL_WORLD_SIZE", world_size)
    for mark in _TORCHRUN_MARKS:
        r.text(mark)
    return World(rank, world_size, local_rank, local_world, master_addr=r.text("MASTER_ADDR"),
                 master_port=_port(r, None), environment=name,
                 node_rank=r.int("GROUP_RANK", 0) if marked else rank // max(1, local_world),
                 num_nodes=max(1, world_size // max(1, local_world)), read=r.read)


def _scheduler(r: _Reader) -> World | None:
    """The Slurm step or MPI job that started this process as one of its tasks, or None."""
    if r.has("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
        return _slurm(r)
    if r.has("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        return _mpi(r, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500")
    if r.has("PMI_SIZE", "PMI_RANK"):
        return _mpi(r, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                    "mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT 29500")
    return None


def _slurm(r: _Reader) -> World:
    world_size = r.int("SLURM_STEP_NUM_TASKS")
    rank = r.int("SLURM_PROCID")
    local_rank = r.int("SLURM_LOCALID", 0)
    node_rank = r.int("SLURM_NODEID", 0)
    num_nodes = r.int("SLURM_STEP_NUM_NODES", r.int("SLURM_NNODES", 1))
    layout = r.text("SLURM_STEP_TASKS_PER_NODE") or r.text("SLURM_TASKS_PER_NODE")
    per_node = tasks_per_node(layout) if layout else [world_size // max(1, num_nodes)] * num_nodes
    local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    nodes = r.text("SLURM_STEP_NODELIST") or r.text("SLURM_JOB_NODELIST") or r.text("SLURM_NODELIST")
    master = r.text("MASTER_ADDR") or (first_host(nodes) if nodes else None)
    job_id = r.text("SLURM_JOB_ID")
    port = _port(r, SLURM_PORT_BASE + int(job_id[-4:]) if job_id and job_id[-4:].isdigit() else DEFAULT_MASTER_PORT)
    if master is None and world_size > 1:
        raise WorldEnvironmentError("Slurm names no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): export "
                                    "MASTER_ADDR=<the first node's host name> before srun")
    return World(rank, world_size, local_rank, local_world, master, port, "slurm", node_rank, num_nodes, r.read,
                 ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"))


def _mpi(r: _Reader, name: str, rank_var: str, size_var: str, local_rank_var: str, local_size_var: str,
         fix: str) -> World:
    world_size, rank = r.int(size_var), r.int(rank_var)
    if world_size > 1 and not r.has(local_rank_var, local_size_var):
        raise WorldEnvironmentError(f"{rank_var} is set but not {local_rank_var}/{local_size_var}: xshard cannot tell "
                                    f"which device is this process's; export LOCAL_RANK, LOCAL_WORLD_SIZE, RANK and "
                                    "WORLD_SIZE to each rank instead")
    local_rank, local_world = r.int(local_rank_var, 0), r.int(local_size_var, 1)
    master = r.text("MASTER_ADDR")
    if master is None and local_world < world_size:
        raise WorldEnvironmentError(
            f"{name}: this job spans several nodes ({size_var}={world_size}, {local_size_var}={local_world}) but MPI "
            f"names no rendezvous host: pass the first node's address to every rank, e.g. `{fix}`")
    return World(rank, world_size, local_rank, local_world, master_addr=master or DEFAULT_MASTER_ADDR,
                 master_port=_port(r, DEFAULT_MASTER_PORT), environment=name, read=r.read,
                 sources=(rank_var, size_var, local_rank_var))


def _kubeflow_pod(r: _Reader) -> World | None:
    """A Kubernetes pod given torchrun's options as PET_* variables (Kubeflow's training operator)."""
    if not r.has("PET_NNODES"):
        return None
    nnodes = r.text("PET_NNODES") or "1"
    if not nnodes.isdigit():  # an elastic range "1:4": torchrun's own rendezvous, not a static placement
        return None
    num_nodes = int(nnodes)
    if num_nodes == 1:
        return None
    node_rank = r.int("PET_NODE_RANK", 0)
    return _checked(World(environment="kubeflow", rank=node_rank, world_size=num_nodes, node_rank=node_rank,
                          num_nodes=num_nodes, master_addr=r.text("PET_MASTER_ADDR"),
                          master_port=r.int("PET_MASTER_PORT", DEFAULT_MASTER_PORT), read=r.read))


# ---------------------------------------------------------------------------- helpers


def _port(r: _Reader, default: int | None) -> int | None:
    return r.int("MASTER_PORT", default) if r.has("MASTER_PORT") or default is not None else None


def _checked(found: World) -> World:
    rank_var, world_var, local_var = found.sources
    if found.world_size < 1:
        raise WorldEnvironmentError(f"{world_var}={found.world_size} must be at least 1")
    if not 0 <= found.rank < found.world_size:
        raise WorldEnvironmentError(f"{rank_var}={found.rank} is outside {world_var}={found.world_size}: check the "
                                    "launcher's environment")
    if found.local_rank < 0:
        raise WorldEnvironmentError(f"{local_var}={found.local_rank} is negative: check the launcher's environment")
    return found


def _torchrun_inside_tasks(scheduler: World) -> str:
    return (f"torchrun runs inside a {scheduler.environment} job that already started {scheduler.local_world_size} tasks on "
            f"this node ({_read_line(scheduler)}): each task started its own torchrun, so the processes do not form "
            f"one job. Either drop torchrun and let {scheduler.environment} start one task per device "
            f"(`srun --ntasks-per-node=<devices> python train.py`), or start one launcher per node "
            "(`srun --ntasks-per-node=1 xshard launch train.py`)")


def _launcher_inside_tasks(scheduler: World) -> str:
    return (f"xshard launch runs inside a {scheduler.environment} job that started {scheduler.local_world_size} tasks on "
            f"this node ({_read_line(scheduler)}), and each task would start its own processes. Either start one "
            "launcher per node (`srun --ntasks-per-node=1 xshard launch train.py`, or mpirun with one process per "
            "node), or leave xshard launch out and let the scheduler start one task per device "
            "(`srun --ntasks-per-node=<devices> python train.py`)")


def _read_line(found: World) -> str:
    keys = [k for k in found.read if "TASKS" in k or "LOCAL" in k or k.endswith("SIZE")]
    return ", ".join(f"{k}={found.read[k]}" for k in keys)


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(layout: str) -> list[int]:
    """Slurm's tasks-per-node list ("2(x3),1" -> [2, 2, 2, 1])."""
    counts: list[int] = []
    for part in layout.split(","):
        match = _TASKS.match(part.strip())
        if match is None:
            raise WorldEnvironmentError(f"cannot read Slurm's tasks per node {layout!r} (expected e.g. '8(x2)' or '2,1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "node[07-09,12],gpu1" -> "node07", "127.0.0.[1-2]" -> "127.0.0.1"."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first entry ends at a comma outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", entry)
    if match is None:
        return entry
    prefix, ranges, rest = match.groups()
    first = ranges.split(",")[0].split("-")[0]
    return first_host(prefix + first + rest) if "[" in rest else prefix + first + rest
