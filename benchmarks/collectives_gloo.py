"""Time gloo's collectives against the ways xshard's CPU backend does the same jobs.

    python benchmarks/collectives_gloo.py                 # 2 and 4 processes, 64 MB fp32, median of 5
    python benchmarks/collectives_gloo.py --world-sizes 2 --mb 16 --repeats 3

Every rank runs with OMP_NUM_THREADS=1. Each operation is timed on every rank between barriers; a
repeat times every column once, in turn (round-robin, so a change in the machine's load hits every
column alike); a repeat's time is the slowest rank's, and the table shows the median over repeats,
in milliseconds.

The buffer is the unsharded tensor: reduce-scatter reduces a ``--mb`` buffer and keeps 1/world of it,
all-gather fills a ``--mb`` buffer from 1/world per rank. "xshard" columns call the CPU backend's own
collectives (``CPUBackend().collective_options()`` into ``DistCollectives``), so they measure whatever
the backend chooses today; the ratio column compares that choice with gloo's own operation (< 1 means
xshard's choice is faster). Reductions use SUM everywhere so every column does the same arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_runner import RankFailure, run_ranks, write_result  # noqa: E402

# torch >= 2.13 renamed these (the old names warn); older torch has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: column key -> header
COLUMNS = {
    "all_reduce": "all_reduce",
    "rs_gloo": "reduce_scatter_tensor (gloo)",
    "rs_all_reduce_slice": "all_reduce + own slice",
    "rs_reduces": "one reduce per rank",
    "rs_xshard": "xshard reduce_scatter",
    "rs_xshard_all_reduce": "xshard, via all_reduce",
    "rs_xshard_reduces": "xshard, via one reduce per rank",
    "rs_xshard_exchange": "xshard, via point-to-point exchange",
    "ag_gloo": "all_gather_into_tensor (gloo)",
    "ag_broadcasts": "one broadcast per rank",
    "ag_xshard": "xshard all_gather",
}


def _operations(numel: int) -> dict[str, Callable[[], None]]:
    """One closure per column; each does the whole job, including any copy of the result."""
    from xshard.backends.collectives import DistCollectives
    from xshard.backends.devices.cpu import CPUBackend

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = numel // world
    full = torch.randn(shard * world)
    part = torch.randn(shard)
    out_full = torch.empty(shard * world)
    out_part = torch.empty(shard)
    xshard = DistCollectives(native_avg=CPUBackend.native_avg, **CPUBackend().collective_options())
    # the forms of reduce-scatter the CPU backend can choose between, explicitly
    via_all_reduce = DistCollectives(native_avg=False, reduce_scatter_form="all_reduce")
    via_reduces = DistCollectives(native_avg=False, reduce_scatter_form="reduce")
    via_exchange = DistCollectives(native_avg=False, reduce_scatter_form="exchange")

    def all_reduce_slice() -> None:
        dist.all_reduce(full)
        out_part.copy_(full[rank * shard:(rank + 1) * shard])

    def reduces() -> None:
        chunks = full.chunk(world)
        for work in [dist.reduce(c, dst=r, async_op=True) for r, c in enumerate(chunks)]:
            work.wait()
        out_part.copy_(chunks[rank])

    def broadcasts() -> None:
        chunks = out_full.chunk(world)
        chunks[rank].copy_(part)
        for work in [dist.broadcast(c, src=r, async_op=True) for r, c in enumerate(chunks)]:
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "rs_gloo": lambda: _reduce_scatter_single(out_part, full),
        "rs_all_reduce_slice": all_reduce_slice,
        "rs_reduces": reduces,
        "rs_xshard": lambda: xshard.reduce_scatter_tensor(out_part, full, op="sum"),
        "rs_xshard_all_reduce": lambda: via_all_reduce.reduce_scatter_tensor(out_part, full, op="sum"),
        "rs_xshard_reduces": lambda: via_reduces.reduce_scatter_tensor(out_part, full, op="sum"),
        "rs_xshard_exchange": lambda: via_exchange.reduce_scatter_tensor(out_part, full, op="sum"),
        "ag_gloo": lambda: _all_gather_single(out_full, part),
        "ag_broadcasts": broadcasts,
        "ag_xshard": lambda: xshard.all_gather_into_tensor(out_full, part),
    }


def worker(mb: float, repeats: int) -> None:
    """One rank: time every operation ``repeats`` times (after one warm-up) and report per-repeat ms."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    numel = int(mb * 2**20) // 4
    operations = _operations(numel)
    times: dict[str, list[float]] = {key: [] for key in operations}
    for op in operations.values():
        dist.barrier()
        op()  # warm-up: first-touch of buffers and gloo's pairs
    # round-robin: every repeat times each column once, so drift in the machine's load (it is shared)
    # spreads over all columns instead of favouring the ones timed while it was quiet
    for _ in range(repeats):
        for key, op in operations.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            times[key].append((time.perf_counter() - start) * 1e3)
    write_result({"rank": dist.get_rank(), "ms": times})
    dist.barrier()
    dist.destroy_process_group()


def summarise(world_size: int, mb: float, per_rank: list[dict]) -> dict:
    """Median over repeats of the slowest rank's time, per column, and xshard's ratios to gloo's own ops."""
    medians = {}
    for key in COLUMNS:
        slowest = [max(r["ms"][key][i] for r in per_rank) for i in range(len(per_rank[0]["ms"][key]))]
        medians[key] = round(statistics.median(slowest), 1)
    return {
        "world_size": world_size,
        "mb": mb,
        "ms": medians,
        "ratio_rs_xshard_to_gloo": round(medians["rs_xshard"] / medians["rs_gloo"], 2),
        "ratio_ag_xshard_to_gloo": round(medians["ag_xshard"] / medians["ag_gloo"], 2),
    }


def print_table(rows: list[dict]) -> None:
    """A markdown table: one row per world size."""
    head = ["world size", *COLUMNS.values(), "xshard/gloo reduce_scatter", "xshard/gloo all_gather"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [str(row["world_size"]), *(f"{row['ms'][k]:.1f}" for k in COLUMNS),
                 f"{row['ratio_rs_xshard_to_gloo']:.2f}", f"{row['ratio_ag_xshard_to_gloo']:.2f}"]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=float, default=64.0, help="size of the unsharded fp32 buffer (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.mb <= 0 or any(w < 2 for w in args.world_sizes):
        parser.error("--repeats must be >= 1, --mb > 0, and every --world-sizes value >= 2")
    if args.worker:
        worker(args.mb, args.repeats)
        return 0
    print(f"gloo collectives, {args.mb:g} MiB fp32 buffer, OMP_NUM_THREADS=1, median of {args.repeats}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores (ms; slowest rank per repeat)")
    rows = []
    for world_size in args.world_sizes:
        try:
            per_rank = run_ranks([os.path.abspath(__file__), "--worker", "--mb", str(args.mb),
                                  "--repeats", str(args.repeats)], world_size)
        except RankFailure as exc:
            print(f"world size {world_size}: failed: {exc}", file=sys.stderr)
            return 1
        rows.append(summarise(world_size, args.mb, per_rank))
        print(json.dumps(rows[-1]), flush=True)
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
