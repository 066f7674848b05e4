"""Start a training script on N processes per node, on the backend XSHARD_BACKEND (or --backend) picks.

Examples:
  xshard launch --nproc 2 train.py --lr 3e-4
  xshard launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 train.py
  xshard launch --backend cuda --devices 0,2 --config ds_config.json train.py

cpu, cuda and npu start processes with torchrun; xla with torch_xla's launcher (one process per local
chip; run it on every host of a pod); mps runs one process. The job's exit code is that of the
first rank that failed, and the message names that rank.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `xshard launch` (underscore and dash spellings both work)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.allow_abbrev = False  # "--dev" after the script must reach the script, not match --devices
    parser.add_argument("--nproc", "--nproc_per_node", "--nproc-per-node", type=int, default=None,
                        help="processes on this node (default: the config's devices, else the backend's device count; "
                             "1 on cpu)")
    parser.add_argument("--nnodes", type=int, default=None, help="number of nodes (default: the config's "
                        "num_nodes, else 1)")
    parser.add_argument("--node_rank", "--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    parser.add_argument("--master_addr", "--master-addr", default="127.0.0.1",
                        help="address of node 0 (default 127.0.0.1)")
    parser.add_argument("--master_port", "--master-port", type=int, default=None,
                        help="port on node 0 (needed with --nnodes > 1; 0 = pick a free one, one node only)")
    parser.add_argument("--devices", default=None,
                        help="device indices to use, e.g. 0,2 (sets the backend's visible-devices variable)")
    parser.add_argument("--backend", default=None, help="auto|cpu|cuda|npu|mps|xla (sets XSHARD_BACKEND; default: XSHARD_BACKEND, the config's backend, auto)")
    parser.add_argument("--config", default=None, help="xshard/DeepSpeed/accelerate config file (XSHARD_CONFIG)")
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                        help="restart the whole job this many times after a failure (torchrun; default 0)")
    parser.add_argument("--join_timeout", "--join-timeout", type=int, default=None,
                        help="seconds a node waits for the others to join (several nodes; torchrun's default 600)")
    parser.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def run(args: argparse.Namespace) -> int:
    """Run `xshard launch`; returns the job's exit code."""
    from xshard.launch import LaunchOptions, launch

    opts = LaunchOptions(
        script=args.script, script_args=list(args.script_args), nproc=args.nproc, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        devices=args.devices, backend=args.backend, config=args.config, module=args.module,
        max_restarts=args.max_restarts, join_timeout=args.join_timeout,
    )
    return launch(opts)
