"""What the failure diagnostics cost per training step: the same-collectives check and the hang monitor.

    python benchmarks/diagnostics_cost.py                 # 2 gloo ranks, stage 3, d=512 MLP stack
    python benchmarks/diagnostics_cost.py --dim 1024 --rounds 4

Two numbers, both from the same sitting:
- ``verify``: one ``Collectives.verify_same_collectives()`` call (what a prepared optimizer runs before
  each step: after the first step it hands the step's record (count and fingerprint of its collectives) to
  the monitor's thread, which compares the ranks' records through the store; the first step, and every step
  with ``XSHARD_CHECK_COLLECTIVES=every-step``, is checked at once with one tiny all-reduce and a host read:
  ``backends/collectives/agreement.py``), timed directly over many calls;
- the monitor (hang diagnosis, ``XSHARD_MONITOR``): the median step time of a stage-3 training step with
  the monitor on and off, in alternating rounds (fresh processes each), printed as a ratio.
Prints one JSON object per configuration and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_runner import RESULT_ENV, run_ranks  # noqa: E402


def _worker(args: argparse.Namespace) -> dict:
    import torch

    from xshard.backends import get_backend
    from xshard.sharding import ShardingOptions, shard_model

    backend = get_backend("cpu")
    backend.init_process_group(timeout=600)
    rank, world = backend.world.rank, backend.world.world_size
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(),
                                  torch.nn.Linear(4 * args.dim, args.dim)) for _ in range(args.layers)]
    model = shard_model(torch.nn.Sequential(*layers), backend,
                        ShardingOptions(stage=3, auto_wrap_policy="size", min_num_params=args.dim * args.dim))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.register_optimizer(opt)  # its step pre-hook runs the same-collectives check
    x = torch.randn(args.batch, args.dim)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    coll = backend.collectives
    checks = []
    for _ in range(args.checks):
        start = time.perf_counter()
        coll.verify_same_collectives()
        checks.append(time.perf_counter() - start)
    backend.destroy_process_group()
    return {"rank": rank, "world": world, "step_s": statistics.median(times),
            "verify_us": 1e6 * statistics.median(checks), "monitor": coll.monitor is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="alternating monitor on/off rounds")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(os.environ[RESULT_ENV]).write_text(json.dumps(_worker(args)))
        return
    argv = [__file__, "--worker", *sys.argv[1:]]
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            results = run_ranks(argv, args.world_size, env={"XSHARD_MONITOR": "1" if mode == "on" else "0"})
            assert all(r["monitor"] == (mode == "on") for r in results)
            runs[mode].append(max(results, key=lambda r: r["step_s"]))
            print(json.dumps({"monitor": mode, **runs[mode][-1]}), flush=True)
    on = statistics.median(r["step_s"] for r in runs["on"])
    off = statistics.median(r["step_s"] for r in runs["off"])
    verify = statistics.median(r["verify_us"] for r in runs["on"] + runs["off"])
    print(f"\nstage 3, d={args.dim}, {args.layers} layers, {args.world_size} gloo ranks, median of {args.rounds} rounds")
    print(f"step time, monitor on / off: {on:.4f} s / {off:.4f} s = {on / off:.3f}x")
    print(f"same-collectives check: {verify:.0f} us per optimizer step = {verify / 1e6 / off:.2%} of a step")


if __name__ == "__main__":
    main()
