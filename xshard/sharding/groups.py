"""The process groups a plan needs: shard groups, replica groups and post-forward groups.

Global ranks are laid out node by node (torchrun numbers the processes of a node consecutively), so
a group of consecutive ranks is a node, or part of one:

    world 8, shard_group_size 4, reshard_after_forward 2
    shard groups          [0 1 2 3] [4 5 6 7]          all-gather, reduce-scatter (inside a node)
    replica groups        [0 4] [1 5] [2 6] [3 7]      all-reduce of the reduced shards (across nodes)
    post-forward groups   [0 1] [2 3] [4 5] [6 7]      backward all-gather of post-forward pieces

A rank's place in its shard group is ``rank % G`` (which rows it holds) and its shard group's index
is ``rank // G`` (which replica it is); the ranks of a replica group hold the same rows.

Every rank makes every group, in this order, through the Backend (``group_collectives``), which is
what c10d requires; the collectives over them count into the job's books with a suffix per kind of
group: ``""`` for the shard group (``all_gather``, ``reduce_scatter``), ``"_inter"`` for the replica
group (``all_reduce_inter``) and ``"_post_forward"`` for the post-forward group
(``all_gather_post_forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan import ShardingPlan

if TYPE_CHECKING:  # types only: the core imports nothing of the device layer at run time
    from xshard.backends import Backend, Collectives

#: counter-kind suffixes per group kind (see the module docstring)
INTER = "_inter"
POST_FORWARD = "_post_forward"


def consecutive_groups(world_size: int, size: int) -> list[list[int]]:
    """``world_size / size`` groups of ``size`` consecutive ranks (shard groups, post-forward groups)."""
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def strided_groups(world_size: int, size: int) -> list[list[int]]:
    """The ranks at the same place of every group of ``size`` consecutive ranks (replica groups)."""
    return [list(range(offset, world_size, size)) for offset in range(size)]


@dataclass
class ProcessGroups:
    """The collectives a sharded model runs over.

    shard: the shard group (the whole world without hybrid sharding): all-gathers, reduce-scatters.
    replicas: the replica group (ranks holding the same rows), None when there is one replica.
    post_forward: the post-forward group of ``reshard_after_forward=k``, None otherwise.
    replica_rank: the index of this rank's shard group (0 for the first replica).
    """

    shard: Collectives
    replicas: Collectives | None
    post_forward: Collectives | None
    replica_rank: int

    @classmethod
    def make(cls, backend: Backend, plan: ShardingPlan) -> ProcessGroups:
        """The groups ``plan`` needs on ``backend``'s job (every rank calls this, in the same order)."""
        world = backend.collectives.world_size
        rank = backend.collectives.rank
        size = plan.shard_group_size
        if not plan.shard_parameters or size == world:
            shard = backend.collectives
        else:
            shard = backend.group_collectives(consecutive_groups(world, size))
        replicas = None
        if plan.shard_parameters and size < world:
            replicas = backend.group_collectives(strided_groups(world, size), INTER)
        post_forward = None
        k = plan.reshard_after_forward.post_forward_group_size
        if k is not None:
            post_forward = backend.group_collectives(consecutive_groups(world, k), POST_FORWARD)
        return cls(shard, replicas, post_forward, rank // size if plan.shard_parameters else 0)
