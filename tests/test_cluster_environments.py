"""Cluster environments: Slurm, MPI launchers, torchrun and Kubeflow variables read as a real starter sets them.

The multi-process cases simulate a 4-rank job on two "nodes" (127.0.0.1 and 127.0.0.2, two tasks
each): every process gets exactly the variables a real ``srun`` or ``mpirun`` gives a task and no
torchrun variable, and the job must train as ``xshard launch --nproc 4`` does (the same final weights).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.distributed import free_port

from xshard.backends import World
from xshard.backends.cluster import SLURM_PORT_BASE, detect, first_host, tasks_per_node
from xshard.cli.launch import LaunchOptions, plan_launch
from xshard.errors import WorldEnvironmentError

SCRIPT = Path(__file__).resolve().parent / "support" / "cluster_train.py"
NODES = "127.0.0.[1-2]"


def slurm_task(rank: int, tasks: int = 4, per_node: int = 2, job_id: str = "4242") -> dict[str, str]:
    """What srun sets for task ``rank`` of a step of ``tasks`` tasks, ``per_node`` per node, on NODES."""
    nodes = tasks // per_node
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": NODES, "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NODELIST": NODES, "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
        "SLURMD_NODENAME": f"127.0.0.{1 + rank // per_node}",
    }


def openmpi_task(rank: int, tasks: int = 4, per_node: int = 2) -> dict[str, str]:
    """What Open MPI's mpirun sets for process ``rank``."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(tasks),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % per_node), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank % per_node), "OMPI_UNIVERSE_SIZE": str(tasks),
    }


# ---------------------------------------------------------------------------- reading the variables


def test_a_slurm_task_finds_its_place_and_the_first_node_as_rendezvous():
    found = detect(slurm_task(3))
    assert (found.environment, found.rank, found.world_size, found.local_rank, found.local_world_size) == ("slurm", 3, 4, 1, 2)
    assert (found.node_rank, found.num_nodes) == (1, 2)
    assert (found.master_addr, found.master_port) == ("127.0.0.1", SLURM_PORT_BASE + 4242)
    assert found.read["SLURM_PROCID"] == "3"
    # MASTER_ADDR / MASTER_PORT override Slurm's conventions
    found = detect({**slurm_task(3), "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "2222"})
    assert (found.master_addr, found.master_port) == ("10.0.0.9", 2222)


def test_a_batch_script_alone_is_one_process_not_a_task_of_many():
    """sbatch sets SLURM_NTASKS for the whole allocation but the batch script is one process (no step)."""
    batch = {k: v for k, v in slurm_task(0).items() if not k.startswith("SLURM_STEP")}
    assert detect(batch).environment == "single" and detect(batch) == World(environment="single")


@pytest.mark.parametrize("env, expected", [
    ({**openmpi_task(2), "MASTER_ADDR": "127.0.0.1"}, ("openmpi", 2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("mpich", 1, 2, 1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
      "TORCHELASTIC_RUN_ID": "x"}, ("torchrun", 1, 2, 1, 2)),
    ({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
      "KUBERNETES_SERVICE_HOST": "10.96.0.1"}, ("kubeflow", 3, 4, 0, 1)),
])
def test_mpi_torchrun_and_kubeflow_variables(env, expected):
    found = detect(env)
    assert (found.environment, found.rank, found.world_size, found.local_rank, found.local_world_size) == expected
    world = detect(env)
    assert (world.rank, world.world_size, world.local_rank) == expected[1:4]


def test_an_mpi_job_on_several_nodes_needs_the_rendezvous_named():
    with pytest.raises(WorldEnvironmentError, match=r"mpirun -x MASTER_ADDR=<host of rank 0>"):
        detect(openmpi_task(0))
    assert detect(openmpi_task(0, tasks=2, per_node=2)).master_addr == "127.0.0.1"  # one node: loopback


def test_torchrun_inside_an_srun_step_with_a_task_per_device_is_refused_naming_the_fix():
    env = {**slurm_task(1), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    with pytest.raises(WorldEnvironmentError, match=r"each task started its own torchrun.*srun --ntasks-per-node=1 "
                                                    r"xshard launch"):
        detect(env)
    # one launcher per node (xshard launch's own ranks under srun): fine
    one_per_node = {**slurm_task(1, tasks=2, per_node=1), "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                    "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert detect(one_per_node).rank == 3


def test_bad_scheduler_values_name_the_variable():
    with pytest.raises(WorldEnvironmentError, match="SLURM_PROCID=4 is outside SLURM_STEP_NUM_TASKS=4"):
        detect({**slurm_task(0), "SLURM_PROCID": "4"})
    with pytest.raises(WorldEnvironmentError, match="cannot read Slurm's tasks per node"):
        tasks_per_node("2(y3)")


def test_slurm_node_lists_and_task_layouts():
    assert first_host("node[07-09,12],gpu1") == "node07"
    assert first_host("gpu1,node[1-4]") == "gpu1"
    assert first_host("rack[2-3]-n[10-11]") == "rack2-n10"
    assert tasks_per_node("8(x2),4") == [8, 8, 4]


# ---------------------------------------------------------------------------- xshard launch under a scheduler


def test_launch_under_srun_one_task_per_node_fills_the_nodes(clean_env, tmp_path):
    env = {**os.environ, **slurm_task(1, tasks=2, per_node=1)}
    plan = plan_launch(LaunchOptions(script=str(SCRIPT), nproc=2), env)
    assert "--nnodes=2" in plan.argv and "--node-rank=1" in plan.argv
    assert "--master-addr=127.0.0.1" in plan.argv and f"--master-port={SLURM_PORT_BASE + 4242}" in plan.argv
    # the command line wins
    plan = plan_launch(LaunchOptions(script=str(SCRIPT), nproc=2, master_port=1234), env)
    assert "--master-port=1234" in plan.argv


def test_launch_inside_a_task_per_device_step_is_refused_naming_the_fix(clean_env):
    env = {**os.environ, **slurm_task(0)}
    with pytest.raises(WorldEnvironmentError, match=r"each task would start its own processes.*"
                                                    r"srun --ntasks-per-node=<devices> python train.py"):
        plan_launch(LaunchOptions(script=str(SCRIPT), nproc=2), env)


def test_launch_in_a_kubeflow_pod_reads_torchruns_pet_variables(clean_env):
    env = {**os.environ, "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0",
           "PET_MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "2"}
    plan = plan_launch(LaunchOptions(script=str(SCRIPT), nproc=2), env)
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=job-master-0", "--master-port=23456"} <= set(plan.argv)


# ---------------------------------------------------------------------------- real jobs without torchrun


def _base_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM", "OMPI_", "PMI_"))}
    return {**env, "XSHARD_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}


def _run_tasks(envs: list[dict[str, str]], out: Path, command: list[str] | None = None, timeout: int = 240) -> None:
    out.mkdir()
    command = command or [sys.executable, str(SCRIPT), str(out)]
    procs = [subprocess.Popen(command, env={**_base_env(), **e}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for e in envs]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-3000:] for o in outputs)


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The reference: the same script under `xshard launch --nproc 4`."""
    out = tmp_path_factory.mktemp("launched") / "out"
    _run_tasks([{}], out, [sys.executable, "-m", "xshard", "launch", "--nproc", "4", str(SCRIPT), str(out)])
    return _records(out, 4)


def _slurm_port_job_id() -> str:
    """A job id whose Slurm rendezvous port (15000 + its last four digits) is free now."""
    start = random.randrange(10000)
    for offset in range(0, 10000, 7):
        digits = (start + offset) % 10000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", SLURM_PORT_BASE + digits))
            except OSError:
                continue
        return f"77{digits:04d}"
    pytest.fail("no free port in Slurm's range 15000-24999")


@pytest.mark.multiprocess
def test_srun_python_train_py_trains_like_xshard_launch(launched, tmp_path):
    job_id = _slurm_port_job_id()
    _run_tasks([slurm_task(r, job_id=job_id) for r in range(4)], tmp_path / "srun")
    records = _records(tmp_path / "srun", 4)
    assert [(r["rank"], r["local_rank"], r["world_size"], r["environment"]) for r in records] == [
        (0, 0, 4, "slurm"), (1, 1, 4, "slurm"), (2, 0, 4, "slurm"), (3, 1, 4, "slurm")]
    assert records[0]["weights"] == launched[0]["weights"]


@pytest.mark.multiprocess
def test_mpirun_python_train_py_trains_like_xshard_launch(launched, tmp_path):
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # mpirun -x MASTER_ADDR -x MASTER_PORT
    _run_tasks([{**openmpi_task(r), **rendezvous} for r in range(4)], tmp_path / "mpi")
    records = _records(tmp_path / "mpi", 4)
    assert [(r["rank"], r["local_rank"], r["environment"]) for r in records] == [
        (0, 0, "openmpi"), (1, 1, "openmpi"), (2, 0, "openmpi"), (3, 1, "openmpi")]
    assert records[0]["weights"] == launched[0]["weights"]


@pytest.mark.multiprocess
def test_srun_xshard_launch_one_per_node_trains_like_xshard_launch(launched, tmp_path):
    job_id = _slurm_port_job_id()
    out = tmp_path / "launchers"
    command = [sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(SCRIPT), str(out)]
    out.mkdir()
    procs = [subprocess.Popen(command, env={**_base_env(), **slurm_task(node, tasks=2, per_node=1, job_id=job_id)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "slurm: node 1 of 2, rendezvous 127.0.0.1" in outputs[1]
    records = _records(out, 4)
    assert [(r["rank"], r["local_rank"], r["environment"]) for r in records] == [
        (0, 0, "torchrun"), (1, 1, "torchrun"), (2, 0, "torchrun"), (3, 1, "torchrun")]
    assert records[0]["weights"] == launched[0]["weights"]


def test_xshard_env_says_which_environment_it_found_and_what_it_read(clean_env):
    env = {**_base_env(), **slurm_task(0)}
    done = subprocess.run([sys.executable, "-m", "xshard", "env"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (f"started by     slurm: rank 0 of 4, local rank 0 of 2, node 0 of 2, rendezvous 127.0.0.1:"
            f"{SLURM_PORT_BASE + 4242}  (read SLURM_STEP_NUM_TASKS=4, SLURM_PROCID=0") in done.stdout
    assert "xshard launch here would be refused" in done.stdout  # two tasks on this node already
