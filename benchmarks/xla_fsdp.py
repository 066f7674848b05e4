"""xshard's sharded core (stage 3) against torch_xla's XlaFullyShardedDataParallel, on XLA.

    PJRT_DEVICE=CPU python benchmarks/xla_fsdp.py                # XLA on this CPU, one replica
    PJRT_DEVICE=CPU python benchmarks/xla_fsdp.py --d 128 --steps 3
    PJRT_DEVICE=TPU python benchmarks/xla_fsdp.py --d 2048 --blocks 16 --batch 64   # a TPU VM: every chip

The script starts its replicas with torch_xla's launcher (``xmp.spawn``: one per local device),
and every replica trains both models, one after the other, in the same process:

- ``xshard-3``: ``shard_model(model, XLABackend, ShardingOptions(stage=3))``, one unit per block,
  ``backend.optimizer_step`` (``optimizer.step()`` then ``mark_step``);
- ``xla-fsdp``: ``XlaFullyShardedDataParallel`` with torch_xla's transformer auto-wrap policy on the
  same blocks, ``optimizer.step()`` then ``torch_xla.sync()``, as torch_xla's docs say.

Same model (benchmarks/mlp.py: residual MLP blocks d -> 4d -> d), same initial weights and batches,
AdamW, fp32. Both warm up (compilation) first; then timed blocks alternate between the two, so a
slow patch of the machine hits both. A step is forward + backward + optimizer step + graph
execution, waited for with ``xm.wait_device_ops()``; the step time is the median over timed steps
of the slowest replica. Printed: a table, the ratio xshard-3 / xla-fsdp (below 1: xshard is faster),
compile counts after warm-up (both should stay flat), the last loss of each (they should agree),
and a JSON line.

On XLA:CPU only one replica runs: XlaFullyShardedDataParallel's collectives carry no channel ids,
and XLA:CPU replicas (threads compiling their own copies of each graph) then never meet in them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from mlp import Block, loss_fn, make_batch, make_model  # noqa: E402

CONFIGS = ("xshard-3", "xla-fsdp")


def _build(name: str, args: argparse.Namespace, backend: Any) -> tuple[torch.nn.Module, Any]:
    """The model under ``name`` on this replica's device, and the function that steps it."""
    import torch_xla

    model = make_model(args.d, args.blocks).to(backend.device())
    if name == "xshard-3":
        from xshard.sharding import ShardingOptions, shard_model

        wrapped = shard_model(model, backend, ShardingOptions(stage=3))
        return wrapped, backend.optimizer_step
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    wrapped = XlaFullyShardedDataParallel(model, auto_wrap_policy=policy)

    def step(optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        torch_xla.sync()

    return wrapped, step


def _train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_fn: Any, x: torch.Tensor,
                 n: int) -> tuple[list[float], torch.Tensor]:
    import torch_xla.core.xla_model as xm

    times, loss = [], None
    for _ in range(n):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x))
        loss.backward()
        step_fn(optimizer)
        xm.wait_device_ops()
        times.append(time.perf_counter() - start)
    return times, loss.detach()


def _replica(index: int, args: argparse.Namespace) -> None:
    import torch_xla.debug.metrics as met

    from xshard.backends import get_backend

    backend = get_backend("xla")
    world = backend.world
    x = make_batch(args.batch * world.world_size, args.seq, args.d, world.rank, world.world_size)
    x = x.to(backend.device())
    runs = {}
    for name in CONFIGS:
        model, step_fn = _build(name, args, backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _train_steps(model, optimizer, step_fn, x, args.warmup)
        runs[name] = {"model": model, "optimizer": optimizer, "step": step_fn, "times": []}
    compiles_before_timing = met.metric_data("CompileTime")[0]
    for _ in range(args.rounds):
        for run in runs.values():
            times, loss = _train_steps(run["model"], run["optimizer"], run["step"], x, args.steps)
            run["times"] += times
            run["loss"] = float(loss.cpu())
    new_compiles = met.metric_data("CompileTime")[0] - compiles_before_timing
    result = {}
    for name, run in runs.items():  # each step's time on the slowest replica, then the median
        slowest = torch.tensor(run["times"], dtype=torch.float32).to(backend.device())
        backend.collectives.all_reduce(slowest, op="max")
        backend.mark_step()
        result[name] = {"step_s": statistics.median(slowest.cpu().tolist()), "loss": run["loss"]}
    if world.rank == 0:
        _report(args, backend, result, new_compiles)


def _report(args: argparse.Namespace, backend: Any, result: dict[str, dict[str, float]], new_compiles: int) -> None:
    import torch_xla

    params = 8 * args.d * args.d * args.blocks + 5 * args.d * args.blocks
    ratio = result["xshard-3"]["step_s"] / result["xla-fsdp"]["step_s"]
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, torch_xla "
          f"{torch_xla.__version__}, device {backend.runtime_device_type()}, {backend.world.world_size} replica(s)")
    print(f"# MLP d={args.d} blocks={args.blocks} ({params / 1e6:.1f}M params), batch {args.batch} x {args.seq} "
          f"per replica, AdamW fp32; {args.warmup} warm-up + {args.rounds} x {args.steps} timed steps each")
    print("| config | step s (median, slowest replica) | last loss |")
    print("|---|---|---|")
    for name in CONFIGS:
        print(f"| {name} | {result[name]['step_s']:.4f} | {result[name]['loss']:.6f} |")
    print(f"ratio xshard-3 / xla-fsdp: {ratio:.2f}; graphs compiled during the timed steps: {new_compiles}")
    print(json.dumps({"benchmark": "xla_fsdp", "device": backend.runtime_device_type(),
                      "replicas": backend.world.world_size, "d": args.d, "blocks": args.blocks,
                      "batch": args.batch, "seq": args.seq, "results": result, "ratio": ratio,
                      "compiles_during_timing": new_compiles}))


def main(argv: list[str] | None = None) -> int:
    """Parse the options, start one replica per local XLA device, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=256, help="block width (parameters: 8 d^2 per block)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per replica")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation) per config")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config and round")
    parser.add_argument("--rounds", type=int, default=2, help="timed blocks per config, alternating")
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla.distributed.xla_multiprocessing as xmp

    # nprocs=None: one replica per local device (all TPU chips; one on XLA:CPU unless CPU_NUM_DEVICES)
    xmp.spawn(_replica, args=(args,), nprocs=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
