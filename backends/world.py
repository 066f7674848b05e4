"""The World: this process's place in the job (rank, sizes, rendezvous), read from its environment.

Its own module so that the contract's roles (``device.py``, ``communication.py``) and ``base.py``
all name it without importing one another: it depends only on ``cluster`` (which reads the
environment) and re-exports its rendezvous defaults, which both ``export`` and the process group use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from . import cluster
from .cluster import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT

__all__ = ["DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT", "World"]


@dataclass(frozen=True)
class World:
    """This process's place in the job: from torchrun's variables, a Slurm step's or an MPI launcher's
    (``cluster.detect``), or one process when none is set."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    #: the rendezvous (node 0's address and port) when the environment names it
    master_addr: str | None = None
    master_port: int | None = None
    #: what started this process: "single", "torchrun", "env", "kubeflow", "slurm", "openmpi", "mpich"
    environment: str = "single"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> World:
        """The world that the environment describes (``backends.cluster``); one process when none is set."""
        found = cluster.detect(os.environ if env is None else env)
        return cls(found.rank, found.world_size, found.local_rank, found.local_world_size, found.master_addr,
                   found.master_port, found.name)

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
