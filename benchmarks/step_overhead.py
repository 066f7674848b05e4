"""The Accelerator's optimizer step against plain PyTorch's on the same model: what the prepared step path costs.

    python benchmarks/step_overhead.py                  # 1 process, CPU, 3 repeats
    python benchmarks/step_overhead.py --layers 400 --repeats 5

What is timed is only the step path a training loop runs after ``backward``: ``optimizer.step()`` and
``optimizer.zero_grad()`` (and, in the "clip" rows, clipping to a global norm of 1.0: the loop's
``clip_grad_norm_`` for plain PyTorch, the config's ``gradient_clipping`` for xshard, which the prepared step
applies). Gradients are set once, before the timed steps, so no forward or backward is in the figures. The
model has many small parameters (``--layers`` linear layers of ``--width``), where per-parameter and
per-call overheads show. Stage 0 in one process: the core's collectives are not in the path, the job
machinery's chain is (``PreparedOptimizer.step`` -> ``Precision.optimizer_step`` -> ``Backend.optimizer_step``).

Printed: the median seconds per step of each, and their ratio (xshard / plain) from the same run; a ratio
near 1.0 means the chain costs nothing next to the optimizer's own work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _model(layers: int, width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _set_grads(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3


def _timed(step: object, model: torch.nn.Module, steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        _set_grads(model, i)  # zero_grad(set_to_none) dropped them: the same gradients each run, untimed
        start = time.perf_counter()
        step()  # type: ignore[operator]
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def plain(layers: int, width: int, clip: bool, steps: int, warmup: int) -> float:
    model = _model(layers, width, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, model, steps, warmup)


def prepared(layers: int, width: int, clip: bool, steps: int, warmup: int) -> float:
    from xshard import Accelerator

    acc = Accelerator(backend="cpu", stage=0, gradient_clipping=1.0 if clip else 0.0)
    model = _model(layers, width, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        return _timed(step, model, steps, warmup)
    finally:
        acc.end()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{args.layers} x Linear({args.width}, {args.width}), AdamW, 1 process (cpu, stage 0), median of "
          f"{args.steps} steps after {args.warmup}, {args.repeats} repeats")
    print("| step path | plain s/step | xshard s/step | xshard / plain |")
    print("|---|---|---|---|")
    for clip in (False, True):
        for _ in range(args.repeats):
            base = plain(args.layers, args.width, clip, args.steps, args.warmup)
            ours = prepared(args.layers, args.width, clip, args.steps, args.warmup)
            label = "step + clip 1.0" if clip else "step"
            print(f"| {label} | {base:.5f} | {ours:.5f} | {ours / base:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
