"""`xshard launch` under a scheduler: nodes, node rank and rendezvous from Slurm, MPI or Kubeflow.

``srun --ntasks-per-node=1 xshard launch train.py`` (or ``mpirun`` with one process per node, or a
Kubeflow pod given ``PET_*`` variables) starts one launcher per node; each fills what the command
line left out from the scheduler's variables (``xshard.backends.cluster.launch_placement``), so the
same command runs on every node. An option given on the command line wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from xshard.backends.cluster import launch_placement
from xshard.cli.launch_options import LaunchOptions
from xshard.runtime.rank_logging import get_logger

log = get_logger("xshard.launch")


def with_cluster_defaults(opts: LaunchOptions, env: Mapping[str, str]) -> LaunchOptions:
    """``opts`` with --nnodes, --node_rank, --master_addr and --master_port filled from the scheduler
    that started this launcher once per node (unchanged when none did)."""
    found = launch_placement(env)
    if found is None:
        return opts
    filled = replace(
        opts,
        nnodes=opts.nnodes if opts.nnodes is not None else found.num_nodes,
        node_rank=opts.node_rank if opts.node_rank is not None else found.node_rank,
        master_addr=opts.master_addr if opts.master_addr is not None else found.master_addr,
        master_port=opts.master_port if opts.master_port is not None else found.master_port,
    )
    log.info("%s: node %d of %d, rendezvous %s:%s (from %s)", found.environment, filled.node_rank, filled.nnodes,
             filled.master_addr, filled.master_port, ", ".join(f"{k}={v}" for k, v in found.read.items()))
    return filled
