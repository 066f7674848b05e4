"""Host reads per training step: the device values xshard's own code reads in a step, by stage.

    python benchmarks/host_reads.py                       # stages 0-3, 2 gloo ranks, 3 warm-up + 5 counted steps
    python benchmarks/host_reads.py --stages 3 --every-step   # the debug check left on (XSHARD_CHECK_COLLECTIVES)

On a GPU or an NPU each such read (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()`` ...) makes the host wait
until the device has drained its queue. The counter (``tests/support/host_reads.py``, the one
``tests/test_no_host_reads.py`` asserts with) counts the calls made directly by xshard's frames in the
optimizer steps after the warm-up: forward, backward, clipping (the config's ``gradient_clipping``), the
optimizer step and ``zero_grad``, with 2 micro-batches accumulated, through the Accelerator. Prints one JSON
object per stage (rank 0's counts and where they come from) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))

from rank_runner import RESULT_ENV, run_ranks  # noqa: E402


def _worker(args: argparse.Namespace) -> dict:
    import torch
    from support.host_reads import HostReads

    import xshard

    acc = xshard.Accelerator(config={"stage": args.stage, "gradient_clipping": 1.0, "gradient_accumulation_steps": 2,
                                     "auto_wrap_policy": "size", "min_num_params": args.dim * args.dim}, seed=0)
    layers = [torch.nn.Sequential(torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(),
                                  torch.nn.Linear(4 * args.dim, args.dim)) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn(64 * (args.warmup + args.steps), args.dim))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    reads = HostReads()
    steps = 0
    with reads:
        for (x,) in loader:
            reads.counting = args.warmup <= steps < args.warmup + args.steps
            with acc.accumulate(model):
                acc.backward(model(x).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            steps += acc.sync_gradients
    acc.end_training()
    return {"stage": args.stage, "reads_per_step": reads.total / args.steps, "where": dict(reads.where)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--stage", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--every-step", action="store_true", help="XSHARD_CHECK_COLLECTIVES=every-step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(os.environ[RESULT_ENV]).write_text(json.dumps(_worker(args)))
        return
    env = {"XSHARD_CHECK_COLLECTIVES": "every-step" if args.every_step else "auto"}
    rows = []
    for stage in args.stages:
        argv = [__file__, "--worker", *sys.argv[1:], "--stage", str(stage)]
        result = run_ranks(argv, args.world_size, env=env)[0]
        print(json.dumps(result), flush=True)
        rows.append(result)
    check = "every-step" if args.every_step else "auto"
    print(f"\nhost reads per optimizer step by xshard's code, {args.world_size} gloo ranks, check={check}")
    print("stage  reads/step")
    for r in rows:
        print(f"{r['stage']:>5}  {r['reads_per_step']:>10.1f}")


if __name__ == "__main__":
    main()
