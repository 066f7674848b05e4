"""The World: this process's place in the job (rank, sizes, rendezvous), read from its environment.

Its own module so that the contract's roles (``device.py``, ``communication.py``), ``base.py`` and
``cluster.py`` (which reads the environment into it) all name it without importing one another: it imports
none of them. The rendezvous defaults live here, used by ``export`` and the process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

#: torchrun's rendezvous defaults, where no cluster names them (``World.export``; ``xshard launch``)
DEFAULT_MASTER_PORT = 29500
DEFAULT_MASTER_ADDR = "127.0.0.1"

__all__ = ["DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "World"]


@dataclass(frozen=True)
class World:
    """This process's place in the job and the rendezvous: the one record of it, read once from whatever
    started the process (``cluster.detect``: torchrun's variables, a Slurm step's, an MPI launcher's, a
    Kubeflow pod's), or one process when none is set. The backend, the ``JobState`` and through them the
    Accelerator and Accelerate's state all ask this object."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    #: the rendezvous (node 0's address and port) when the environment names it
    master_addr: str | None = None
    master_port: int | None = None
    #: what started this process: "single", "torchrun", "env", "kubeflow", "slurm", "openmpi", "mpich"
    environment: str = "single"
    #: this node's rank and the node count (-1: derived from the local world size, as torchrun places ranks)
    node_rank: int = -1
    num_nodes: int = -1
    #: the variables it was read from, name -> value (what `xshard env` shows)
    read: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    #: the variables that gave the rank, the world size and the local rank (for messages)
    sources: tuple[str, str, str] = field(default=("RANK", "WORLD_SIZE", "LOCAL_RANK"), compare=False, repr=False)

    def __post_init__(self) -> None:
        per_node = max(1, self.local_world_size)
        if self.node_rank < 0:
            object.__setattr__(self, "node_rank", self.rank // per_node)
        if self.num_nodes < 0:
            object.__setattr__(self, "num_nodes", max(1, self.world_size // per_node))

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0 (the process that logs, saves and reports)."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 of each node (the process that writes a node's local files)."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.rank == self.world_size - 1

    @property
    def use_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    def describe(self) -> str:
        """One line: the environment and what it gives."""
        if self.environment == "single":
            return "no launcher or scheduler: one process"
        where = "" if self.master_addr is None else f", rendezvous {self.master_addr}:{self.master_port}"
        return (f"{self.environment}: rank {self.rank} of {self.world_size}, local rank {self.local_rank} of "
                f"{self.local_world_size}, node {self.node_rank} of {self.num_nodes}{where}")

    def export(self, env: MutableMapping[str, str] | None = None) -> None:
        """Put this world into torchrun's variables where they are unset (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that c10d's rendezvous and any code that reads
        them see the job a Slurm step or an MPI launcher described."""
        env = os.environ if env is None else env
        values = {
            "RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
            "LOCAL_WORLD_SIZE": self.local_world_size, "MASTER_ADDR": self.master_addr or DEFAULT_MASTER_ADDR,
            "MASTER_PORT": self.master_port if self.master_port is not None else DEFAULT_MASTER_PORT,
        }
        for key, value in values.items():
            env.setdefault(key, str(value))
