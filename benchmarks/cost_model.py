"""A step-time model fitted to ``sharding_vs_peers.py`` runs, and what it projects for 8 and 64 NPUs.

    python benchmarks/sharding_vs_peers.py --world-size 2 --sizes 512 1024 1536 \\
        --configs limit limit-fullopt ddp fsdp2 xshard-0 xshard-2 xshard-3 > runs.txt
    python benchmarks/sharding_vs_peers.py --world-size 4 --sizes 512 1024 1536 \\
        --configs limit limit-fullopt ddp fsdp2 xshard-0 xshard-2 xshard-3 >> runs.txt
    python benchmarks/cost_model.py runs.txt            # fit, then project (assumptions printed)

The model, one line per step and rank:

    step = compute floor x oversubscription + bytes asked of the collectives / bandwidth

- compute floor: the ``limit`` configuration (one process, one rank's batch, AdamW over 1/N of the
  parameters) for stages 1-3, ``limit-fullopt`` (AdamW over all of them) for DDP and stage 0, at the
  same width and world size. Oversubscription: max(1, ranks / cores), since N ranks on fewer cores
  share them.
- bytes: what each rank asked of torch.distributed per step, as the benchmark counted it, times
  (N - 1) / N: what a ring puts on each rank's link (all-gather counted by its output, reduce-scatter
  by its input, all-reduce twice: each rank receives all but its own 1/N).
- bandwidth: one figure, fitted by least squares over every distributed run in the files. Nothing is
  assumed hidden behind compute: on a CPU machine gloo's copies run on the same cores as the model.

Each run's residual (measured / model) then says what the bytes do not explain: above 1, the
framework's own overhead; below 1, communication it hid.

The projection keeps the form and swaps the machine: compute from FLOPs at an assumed MFU, the
optimizer from HBM bandwidth, bytes from the formulas below (bf16 gathers, fp32 gradient reduction:
xshard's mixed-precision defaults), model state from ``xshard.estimate``, times from assumed link speeds. It prints two bounds: serial
(the fitted form: nothing hidden) and overlapped (communication hidden behind the whole compute but
for one layer's share, the first gather and the last reduction). Every assumption is printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xshard.estimate import PRECISIONS, model_state_bytes  # noqa: E402

GB = 1e9

#: configuration -> the compute floor it is measured against. The hybrid configurations are left out
#: of the fit: their groups' rings are shorter than the world's, so (N - 1) / N does not give their bytes.
FLOOR_OF = {"ddp": "limit-fullopt", "xshard-0": "limit-fullopt", "ds-zero2": "limit", "ds-zero3": "limit",
            "fsdp2": "limit", "xshard-2": "limit", "xshard-3": "limit"}


# ------------------------------------------------------------------------------------------- fit
def read_runs(paths: list[str]) -> dict[tuple[str, int, int], dict]:
    """(config, d, world size) -> the benchmark's record (the last one, if a file repeats a configuration).

    The world size is the run's (its header line says "N ranks on gloo"): the one-process ``limit``
    configurations record ``ranks: 1`` but run one rank's share of an N-rank job.
    """
    runs = {}
    for path in paths:
        world = None
        with open(path) as f:
            for line in f:
                header = re.search(r"(\d+) ranks on gloo", line) if line.startswith("# sharding_vs_peers") else None
                if header:
                    world = int(header.group(1))
                elif line.startswith("{"):
                    r = json.loads(line)
                    if "step_s" in r:
                        runs[(r["config"], r["d"], world or r["ranks"])] = r
    return runs


@dataclass
class Fit:
    seconds_per_gb: float  # 1 / the fitted bandwidth
    rows: list[dict]


def fit(runs: dict[tuple[str, int, int], dict], cores: int) -> Fit:
    """Fit the one bandwidth of ``step = floor x oversubscription + bytes / bandwidth``."""
    points = []
    for (config, d, ranks), r in sorted(runs.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        floor = runs.get((FLOOR_OF.get(config, ""), d, ranks))
        if floor is None or "sent_mb" not in r:
            continue
        compute = floor["step_s"] * max(1.0, ranks / cores)
        points.append({"config": config, "d": d, "ranks": ranks, "params": r["params"], "step": r["step_s"],
                       "compute": compute, "gb": r["sent_mb"] * 1e6 / GB * (ranks - 1) / ranks,
                       "load": r.get("load_avg_1m")})
    if not points:
        raise SystemExit("cost_model: no distributed run has its compute floor (limit / limit-fullopt) at the same "
                         "width and world size in these files; run sharding_vs_peers.py with those configs too")
    num = sum(p["gb"] * (p["step"] - p["compute"]) for p in points)
    den = sum(p["gb"] ** 2 for p in points)
    k = max(num / den, 0.0)
    for p in points:
        p["model"] = p["compute"] + k * p["gb"]
    return Fit(k, points)


def print_fit(result: Fit, cores: int) -> None:
    print(f"## Fitted on this machine ({cores} cores): bandwidth {1 / result.seconds_per_gb:.2f} GB/s "
          f"(bytes per rank on a ring's links)\n" if result.seconds_per_gb > 0 else
          "## Fitted: the bytes explain none of the time\n")
    print("| ranks | d | params | config | compute s (floor x oversub.) | GB on links/rank | measured s | model s | "
          "measured / model | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in result.rows:
        print(f"| {p['ranks']} | {p['d']} | {p['params'] / 1e6:.0f}M | {p['config']} | {p['compute']:.3f} | "
              f"{p['gb']:.3f} | {p['step']:.3f} | {p['model']:.3f} | {p['step'] / p['model']:.2f} | {p['load']} |")
    ss_res = sum((p["step"] - p["model"]) ** 2 for p in result.rows)
    mean = sum(p["step"] for p in result.rows) / len(result.rows)
    ss_tot = sum((p["step"] - mean) ** 2 for p in result.rows) or 1.0
    print(f"\nR^2 of the model over {len(result.rows)} runs: {1 - ss_res / ss_tot:.3f}; "
          f"mean measured/model per configuration: " + ", ".join(
              f"{c} {sum(p['step'] / p['model'] for p in rs) / len(rs):.2f}"
              for c, rs in _by_config(result.rows).items()))


def _by_config(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in rows:
        out.setdefault(p["config"], []).append(p)
    return out


# ------------------------------------------------------------------------------------ projection
@dataclass
class Machine:
    """The assumed accelerator and links (the defaults: an 8 x Ascend 910B node, see --help)."""

    peak_tflops: float = 320.0  # bf16/fp16 dense peak per NPU (third-party figure, +-15%)
    mfu: float = 0.40  # achieved fraction of peak in the model's matmuls
    hbm_gbs: float = 1600.0  # HBM bandwidth, for the optimizer step (memory-bound)
    intra_gbs: float = 150.0  # collective bandwidth per NPU inside a node (HCCS full mesh)
    inter_gbits: float = 200.0  # network per NPU between nodes (one NIC per NPU)
    per_node: int = 8
    layers: int = 28  # units: the share of traffic that cannot hide is one unit's


@dataclass
class Job:
    params: float  # parameters
    tokens: int  # tokens per rank per step
    ranks: int
    shard_group: int  # ranks sharing one copy of the shards (= ranks unless hybrid)


def traffic_gb(stage: int, job: Job, param_bytes: int = 2, reduce_bytes: int = 4) -> tuple[float, float]:
    """(GB inside a shard group, GB across shard groups) each rank sends per step, for ring collectives.

    stage 0 / DDP: all-reduce of the gradients over all ranks. Stage 2: reduce-scatter of the
    gradients, all-gather of the updated parameters. Stage 3: all-gather in forward and again in
    backward, reduce-scatter of the gradients. Hybrid (shard group G < N): the gathers and the
    reduce-scatter stay in the group; the reduced shards (1/G of the gradients) are all-reduced
    across the N/G groups.
    """
    p, n, g = job.params, job.ranks, job.shard_group
    if stage == 0:
        return 0.0, 2 * (n - 1) / n * p * reduce_bytes / GB
    gathers = 1 if stage == 2 else 2
    inside = (g - 1) / g * p * (gathers * param_bytes + reduce_bytes) / GB
    replicas = n // g
    across = 2 * (replicas - 1) / replicas * (p / g) * reduce_bytes / GB
    return inside, across


def state_gb(stage: int, job: Job) -> float:
    """Model state per rank under bf16 mixed precision (xshard's estimator: ZeRO's formulas), with the
    shard group as the sharding degree; activations and the gathered units aside."""
    return sum(model_state_bytes(job.params, job.shard_group, stage, PRECISIONS["bf16"])) / GB


def project(stage: int, job: Job, m: Machine) -> dict:
    """Compute, communication and the two step-time bounds of one configuration."""
    compute = 6 * job.params * job.tokens / (m.peak_tflops * 1e12 * m.mfu)
    optimizer_params = job.params if stage == 0 else job.params / job.shard_group
    optimizer = optimizer_params * 28 / (m.hbm_gbs * GB)  # AdamW reads 16 B and writes 12 B per parameter
    inside, across = traffic_gb(stage, job)
    spans_nodes = job.ranks > m.per_node
    # a group within a node runs at HCCS speed; one that spans nodes runs at the network's (a flat ring
    # is as slow as its slowest hop)
    group_spans_nodes = job.shard_group > m.per_node
    inter = m.inter_gbits / 8
    t_inside = inside / (inter if group_spans_nodes else m.intra_gbs)
    t_across = across / (inter if spans_nodes else m.intra_gbs)
    comm = t_inside + t_across
    serial = compute + optimizer + comm
    overlapped = compute + optimizer + max(comm - compute, comm / m.layers)
    return {"compute": compute + optimizer, "comm": comm, "serial": serial, "overlapped": overlapped,
            "state": state_gb(stage, job), "inside": inside, "across": across}


SCENARIOS = [  # (label, stage, ranks, shard group or None for all ranks)
    ("DDP / stage 0, 8 ranks", 0, 8, None),
    ("stage 2, 8 ranks", 2, 8, None),
    ("stage 3, 8 ranks", 3, 8, None),
    ("DDP / stage 0, 64 ranks", 0, 64, None),
    ("stage 3 over all 64", 3, 64, None),
    ("hybrid stage 3, 8 x 8", 3, 64, 8),
    ("hybrid stage 2, 8 x 8", 2, 64, 8),
]


def print_projection(params: float, token_counts: list[int], m: Machine, hbm_capacity_gb: float) -> None:
    print(f"\n## Projection: {params / 1e9:.2f}B parameters\n")
    print(f"Assumed: {m.peak_tflops:.0f} TFLOPS peak at {m.mfu:.0%} MFU; HBM {m.hbm_gbs:.0f} GB/s for AdamW; "
          f"collectives at {m.intra_gbs:.0f} GB/s per NPU inside a node of {m.per_node}, "
          f"{m.inter_gbits:.0f} Gb/s per NPU between nodes; flat rings; bf16 gathers, fp32 gradient "
          f"reduction; {m.layers} units. Model state excludes activations and gathered units; "
          f"over {hbm_capacity_gb:.0f} GB it does not fit.\n")
    print("| tokens/rank/step | configuration | compute+opt s | comm s (GB in group + across) | "
          "step s, serial | step s, overlapped | tokens/s/rank (overlapped) | state GB/rank |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in token_counts:
        for label, stage, ranks, group in SCENARIOS:
            job = Job(params, tokens, ranks, group or ranks)
            r = project(stage, job, m)
            fits = "" if r["state"] <= hbm_capacity_gb else " (does not fit)"
            print(f"| {tokens} | {label} | {r['compute']:.3f} | {r['comm']:.3f} ({r['inside']:.1f} + "
                  f"{r['across']:.1f}) | {r['serial']:.3f} | {r['overlapped']:.3f} | "
                  f"{tokens / r['overlapped']:.0f} | {r['state']:.1f}{fits} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="output files of sharding_vs_peers.py (its JSON lines)")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores of the machine the runs were taken on (default: this machine's)")
    parser.add_argument("--params", type=float, default=7.6e9, help="parameters of the projected model "
                        "(default 7.6e9: Qwen2.5-7B)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 8192],
                        help="tokens per rank per step (default: 512, the Alpaca recipe's batch 1 x 512, and 8192)")
    parser.add_argument("--inter-gbits", type=float, nargs="+", default=[100.0, 400.0],
                        help="network speed per NPU between nodes, Gb/s (default: 100 and 400)")
    parser.add_argument("--intra-gbs", type=float, default=Machine.intra_gbs)
    parser.add_argument("--mfu", type=float, default=Machine.mfu)
    parser.add_argument("--peak-tflops", type=float, default=Machine.peak_tflops)
    parser.add_argument("--hbm-capacity-gb", type=float, default=64.0)
    args = parser.parse_args(argv)
    if args.runs:
        runs = read_runs(args.runs)
        print_fit(fit(runs, args.cores), args.cores)
    for gbits in args.inter_gbits:
        m = Machine(peak_tflops=args.peak_tflops, mfu=args.mfu, intra_gbs=args.intra_gbs, inter_gbits=gbits)
        print_projection(args.params, args.tokens, m, args.hbm_capacity_gb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
