"""Lifetime peak host memory per rank for a model built in code: DDP, stage 3, stage 3 with sharded init.

    python benchmarks/init_memory.py                      # d=1024, 8 blocks (67M params), 2 ranks
    python benchmarks/init_memory.py --d 2048 --blocks 8 --nproc 2

The model is benchmarks/mlp.py's, built the way a user writes it (``torch.manual_seed(0); MLP(d, n)``),
then trained for a few AdamW steps in fp32. Each mode runs in its own fresh processes:

- ``ddp``: the whole model on every rank, ``DistributedDataParallel``;
- ``stage3``: the whole model on every rank, then ``accelerator.prepare`` at stage 3 (the whole model is
  held until ``prepare`` frees what the rank does not own, so the peak sees it);
- ``stage3-sharded-init``: built inside ``accelerator.sharded_init()``: parameters on the meta device,
  materialized by ``prepare`` one parameter at a time, each rank keeping its rows.

Each rank reports VmHWM (the lifetime peak of its resident memory, /proc/self/status) once the model is
ready (``prepare`` / the DDP wrapper: the init's own peak) and after the steps (the lifetime peak), and
VmRSS after the imports, so the model's own share (peak - imports) is visible beside the total.
glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which freed
blocks below it stay in the heap: the lifetime peak of a model whose units are under 32 MiB depends on
that (compare with ``MALLOC_MMAP_THRESHOLD_=1048576``, which fixes the threshold).
Ratios are to DDP's, from the same sitting. Memory figures are not disturbed by other load on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loading_memory import status_kib  # noqa: E402
from rank_runner import run_ranks, write_result  # noqa: E402

MODES = ("ddp", "stage3", "stage3-sharded-init")


def _worker(mode: str, d: int, blocks: int, steps: int) -> None:
    import torch
    from mlp import MLP, loss_fn, make_batch

    import xshard

    after_imports = status_kib("VmRSS")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = make_batch(8, 32, d, rank, world)
    if mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(MLP(d, blocks))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        after_prepare = status_kib("VmHWM")
    else:
        acc = xshard.Accelerator(config={"stage": 3}, log_level="warning")
        torch.manual_seed(0)
        if mode == "stage3-sharded-init":
            with acc.sharded_init():
                net = MLP(d, blocks)
        else:
            net = MLP(d, blocks)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        model, opt = acc.prepare(net, opt)
    after_prepare = status_kib("VmHWM")  # the init's own peak: before any step
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(batch))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    held = sum(p.numel() for p in model.parameters())
    write_result({"mode": mode, "rank": rank, "peak_kib": status_kib("VmHWM"), "after_imports_kib": after_imports,
                  "init_peak_kib": after_prepare, "params_held": held, "losses": losses})


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.d, args.blocks, args.steps)
        return 0
    params = args.blocks * (8 * args.d * args.d + 5 * args.d)
    print(f"MLP d={args.d} x {args.blocks} blocks: {params / 1e6:.0f}M parameters, "
          f"{params * 4 / 2**20:.0f} MiB fp32; {args.nproc} ranks, {args.steps} AdamW steps")
    env = {"XSHARD_BACKEND": "cpu"}
    results = {}
    for mode in args.modes:
        argv_mode = [__file__, "--worker", mode, "--d", str(args.d), "--blocks", str(args.blocks),
                     "--steps", str(args.steps)]
        results[mode] = run_ranks(argv_mode, args.nproc, env=env)
    base = results.get("ddp")
    print("\n| mode | init peak - imports MiB | / DDP | lifetime peak RSS MiB | peak - imports MiB | / DDP (peak) | "
          "/ DDP (peak - imports) | params held per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, ranks in results.items():
        peak = max(r["peak_kib"] for r in ranks)
        own = max(r["peak_kib"] - r["after_imports_kib"] for r in ranks)
        init = max(r["init_peak_kib"] - r["after_imports_kib"] for r in ranks)
        ratios = ("-", "-", "-")
        if base is not None:
            base_peak = max(r["peak_kib"] for r in base)
            base_own = max(r["peak_kib"] - r["after_imports_kib"] for r in base)
            base_init = max(r["init_peak_kib"] - r["after_imports_kib"] for r in base)
            ratios = (f"{init / base_init:.2f}", f"{peak / base_peak:.2f}", f"{own / base_own:.2f}")
        print(f"| {mode} | {init / 1024:.0f} | {ratios[0]} | {peak / 1024:.0f} | {own / 1024:.0f} | {ratios[1]} | "
              f"{ratios[2]} | {max(r['params_held'] for r in ranks) / 1e6:.1f}M |")
    same = len({tuple(round(x, 6) for x in ranks[0]["losses"]) for ranks in results.values()}) == 1
    print(f"\nlosses equal across modes (6 digits): {same}")
    print(json.dumps({"params": params, "nproc": args.nproc, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
