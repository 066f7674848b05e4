"""Ranks on different paths: a branchy model's step at stage 3 against stage 0, and against the same model
where every rank takes the same path.

    python benchmarks/branchy_paths.py                          # d=384, 2 ranks, 2 warm-up + 6 timed steps
    python benchmarks/branchy_paths.py --d 256 --steps 4        # a quick look
    python benchmarks/branchy_paths.py --configs branchy-3 same-3 --repeats 3

The model has what real programs branch over, each block a unit of its own (``_no_split_modules``): an
image tower (``--vision`` residual MLP blocks d -> 4d -> d) that the batches of odd ranks have no image
for, ``--text`` text blocks every rank runs, and ``--experts`` routed experts (top-1: every token goes to
one expert, so an expert's work is its share of the tokens). Two data layouts of the same model:

- ``branchy``: images on even ranks only; rank r's tokens go to expert 0 and to expert 1 + (r % (E - 2)),
  so each of experts 1..E-2 gets no token on some rank and expert E-1 none on any rank;
- ``same``: images on every rank and each rank's tokens spread over all E experts: every rank runs every
  unit in the same order (no unit is passed).

Configurations (``--configs``), each in its own fresh set of gloo rank processes, one after another:
``branchy-0``, ``branchy-3``, ``same-0``, ``same-3``: the layout at ``ShardingOptions(stage=0)`` (DDP's
bucketed all-reduce) or ``stage=3`` (FULL_SHARD), ``torch.optim.AdamW``, fp32, OMP_NUM_THREADS=1 per rank.
The routing is data, made with the batch (each expert's token indices), so the forward reads nothing on
the host itself.

Measured per configuration:
- **s/step**: the median over the timed steps of the slowest rank's step (zero_grad, forward, backward,
  optimizer step), after the warm-up steps; **CPU s/step** the process's CPU time (all its threads) per
  timed step, median, the most over ranks (less moved by other work on the machine than wall time); with
  ``--repeats R`` the configurations run round robin R times and the table shows the median of the R medians;
- **units passed/step**: ``stats()["gathers"]["passed"]``, the units a rank took part in the collectives of
  without running them (forward and backward passes both count), per rank;
- **host reads/step**: the device values xshard's own code read in a step (``tests/support/host_reads.py``,
  the counter ``host_reads.py`` and ``tests/test_no_host_reads.py`` use), in 2 more steps after the timed
  ones (its wrappers stay out of the timing), per rank, with where they come from (the most over ranks);
- **MB sent/step/rank**: xshard's own counter (``stats()["comm"]``): the same at every layout of one stage
  when the ranks issue the same collectives;
- ratios in one run: stage 3 / stage 0 of each layout, and branchy / same at each stage (what the
  branch costs); with ``--repeats`` each ratio is taken within a round (the configurations of one round ran
  minutes apart) and the table shows the median over the rounds and their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))

from rank_runner import RankFailure, run_ranks, write_result  # noqa: E402

CONFIGS = ("branchy-0", "branchy-3", "same-0", "same-3")


# ------------------------------------------------------------------------------------------ one rank
def _model(args: argparse.Namespace):
    import torch
    from mlp import Block  # x + W2 gelu(W1 x): one unit
    from torch import nn

    class Branchy(nn.Module):
        """Token and patch embeddings (the root), an image tower, text blocks, routed experts, a head."""

        _no_split_modules = ["Block"]

        def __init__(self, d: int) -> None:
            super().__init__()
            self.embed = nn.Linear(d, d)
            self.pixels = nn.Linear(d, d)
            self.vision = nn.ModuleList(Block(d) for _ in range(args.vision))
            self.text = nn.ModuleList(Block(d) for _ in range(args.text))
            self.experts = nn.ModuleList(Block(d) for _ in range(args.experts))
            self.head = nn.Linear(d, d)

        def forward(self, x: torch.Tensor, image: torch.Tensor | None, tokens_of: list[torch.Tensor]) -> torch.Tensor:
            h = self.embed(x)
            if image is not None:  # batches without an image skip the tower
                v = self.pixels(image)
                for block in self.vision:
                    v = block(v)
                h = h + v.mean(dim=1, keepdim=True)
            for block in self.text:
                h = block(h)
            flat = h.reshape(-1, h.shape[-1])
            moe = torch.zeros_like(flat)
            for expert, index in zip(self.experts, tokens_of, strict=True):
                if index.numel():  # as Mixtral's loop: an expert with no token here is skipped
                    moe = moe.index_add(0, index, expert(flat[index]))
            return self.head((flat + moe).reshape(h.shape))

    torch.manual_seed(0)
    return Branchy(args.d)


def _batch(args: argparse.Namespace, layout: str, rank: int) -> dict:
    """This rank's batch: tokens, an image or None, each expert's token indices (top-1 routing as data)."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch, args.seq, args.d, generator=g)
    images = layout == "same" or rank % 2 == 0
    image = torch.randn(args.batch, args.patches, args.d, generator=g) if images else None
    tokens = args.batch * args.seq
    if layout == "same":
        route = torch.arange(tokens) % args.experts
    else:  # half to expert 0, half to this rank's own expert; the last expert gets none anywhere
        route = torch.where(torch.arange(tokens) % 2 == 0, 0, 1 + rank % max(1, args.experts - 2))
    tokens_of = [(route == e).nonzero().squeeze(-1) for e in range(args.experts)]
    return {"x": x, "image": image, "tokens_of": tokens_of}


def _worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from support.host_reads import HostReads

    from xshard.backends.devices.cpu import CPUBackend
    from xshard.sharding import ShardingOptions, shard_model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    layout, stage = args.config.rsplit("-", 1)
    backend = CPUBackend()
    backend.init_process_group()
    model = _model(args)
    numel = sum(p.numel() for p in model.parameters())
    sm = shard_model(model, backend, ShardingOptions(stage=int(stage), auto_wrap_policy="transformer"))
    optimizer = torch.optim.AdamW(sm.parameters(), lr=1e-4)
    sm.register_optimizer(optimizer)
    b = _batch(args, layout, rank)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        sm(b["x"], b["image"], b["tokens_of"]).float().pow(2).mean().backward()
        optimizer.step()

    times, cpu = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sm.reset_stats()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    stats = sm.stats()
    counted = 2
    reads = HostReads()
    with reads:
        for _ in range(counted):
            dist.barrier()
            step()
    result = {
        "rank": rank, "step_s": times, "cpu_s": cpu, "units": stats["units"],
        "params": numel,
        "passed_per_step": stats["gathers"].get("passed", 0) / args.steps,
        "sent_mb_per_step": sum(stats["comm"]["bytes"].values()) / 1e6 / args.steps,
        "reads_per_step": reads.total / counted, "reads_where": dict(reads.where),
    }
    dist.barrier()
    backend.destroy_process_group()
    return result


# ------------------------------------------------------------------------------------------ driver
def _summary(per_rank: list[dict]) -> dict:
    steps = [max(r["step_s"][i] for r in per_rank) for i in range(len(per_rank[0]["step_s"]))]
    where: dict[str, float] = {}
    for r in per_rank:
        for k, v in r["reads_where"].items():
            where[k] = max(where.get(k, 0), v / 2)
    return {
        "step_s": statistics.median(steps), "step_s_range": [min(steps), max(steps)],
        "cpu_s": max(statistics.median(r["cpu_s"]) for r in per_rank),
        "passed_per_step": [r["passed_per_step"] for r in per_rank],
        "reads_per_step": [r["reads_per_step"] for r in per_rank], "reads_where_per_step": where,
        "sent_mb_per_step": max(r["sent_mb_per_step"] for r in per_rank), "units": per_rank[0]["units"],
        "params": per_rank[0]["params"],
    }


def _ratio(runs: dict[str, list[dict]], config: str, base: str, key: str = "step_s") -> str:
    """``config``'s s/step (or ``key``) over ``base``'s, round by round: the median, and the range when several rounds ran."""
    pairs = list(zip(runs.get(config, []), runs.get(base, []), strict=False))
    if not pairs:
        return ""
    ratios = sorted(a[key] / b[key] for a, b in pairs)
    text = f"{statistics.median(ratios):.2f}"
    return text + (f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--d", type=int, default=384, help="model width")
    parser.add_argument("--vision", type=int, default=3, help="image-tower blocks")
    parser.add_argument("--text", type=int, default=3, help="text blocks")
    parser.add_argument("--experts", type=int, default=4, help="routed experts (at least 3)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--patches", type=int, default=64, help="image patches per sequence")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="round-robin runs of all the configurations")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        write_result(_worker(args))
        return
    if args.experts < 3:
        parser.error("--experts must be at least 3 (a shared one, one per rank group, one that gets no token)")
    print(f"# branchy_paths {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPU cores, "
          f"{args.world_size} ranks on gloo, OMP_NUM_THREADS=1, d={args.d}, {args.vision} vision + {args.text} text "
          f"blocks + {args.experts} experts, batch {args.batch}x{args.seq} tokens (+{args.patches} patches) per rank, "
          f"AdamW fp32, {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} round(s)", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    loads: dict[str, list[float]] = {c: [] for c in args.configs}
    for _ in range(args.repeats):
        for config in args.configs:
            argv = [__file__, "--worker", "--config", config, *[a for a in sys.argv[1:] if a != "--worker"]]
            try:
                per_rank = run_ranks(argv, args.world_size, env={"XSHARD_LOG_LEVEL": "warning"})
            except RankFailure as exc:
                print(json.dumps({"config": config, "failed": str(exc).splitlines()[-1][:300]}), flush=True)
                print(f"  {config}: {exc}", file=sys.stderr)
                continue
            row = _summary(per_rank)
            loads[config].append(round(os.getloadavg()[0], 1))
            runs[config].append(row)
            print(json.dumps({"config": config, **row, "load_avg_1m": loads[config][-1]}), flush=True)
    rows = {c: {**rs[-1], "step_s": statistics.median(r["step_s"] for r in rs),
                "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                "medians": [round(r["step_s"], 3) for r in rs]} for c, rs in runs.items() if rs}
    if not rows:
        sys.exit(1)
    first = next(iter(rows.values()))
    print(f"\n{first['params'] / 1e6:.1f}M parameters, {first['units']} units (the root and one per block)")
    head = ["config", "s/step", "x stage 0", "x same path", "CPU s/step", "CPU x stage 0", "CPU x same path", "units passed/step (per rank)",
            "host reads/step (per rank)", "MB sent/step/rank (own counter)", "load (1 min)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for config, r in rows.items():
        layout, stage = config.rsplit("-", 1)
        x0 = _ratio(runs, config, f"{layout}-0") if stage != "0" else ""
        xs = _ratio(runs, config, f"same-{stage}") if layout != "same" else ""
        c0 = _ratio(runs, config, f"{layout}-0", "cpu_s") if stage != "0" else ""
        cs = _ratio(runs, config, f"same-{stage}", "cpu_s") if layout != "same" else ""
        step = f"{r['step_s']:.3f}" + (f" ({', '.join(map(str, r['medians']))})" if len(r["medians"]) > 1 else "")
        cells = [config, step, x0, xs, f"{r['cpu_s']:.3f}", c0, cs, " / ".join(f"{p:g}" for p in r["passed_per_step"]),
                 " / ".join(f"{p:g}" for p in r["reads_per_step"]), f"{r['sent_mb_per_step']:.1f}",
                 " ".join(map(str, loads[config]))]
        print("| " + " | ".join(cells) + " |")
    print("\nhost reads by xshard's code per step, where (the most over ranks):")
    for config, r in rows.items():
        for where, n in sorted(r["reads_where_per_step"].items()):
            print(f"  {config}: {n:g} x {where}")


if __name__ == "__main__":
    main()
