"""A prepared data loader's cost per batch: xshard's against Accelerate's, same data, same ranks, one run.

    python benchmarks/loader_overhead.py                     # 2 ranks; map-style and iterable; 0 and 2 workers
    python benchmarks/loader_overhead.py --batches 400 --repeats 3

What is timed is the loop a training script runs over a prepared loader, with no model: ``for batch in
loader`` over ``--batches`` batches of ``--batch-size`` token rows (``input_ids`` and ``attention_mask``, a
dict per sample, collated by torch's default collate), after the first batch. Each configuration runs in a
fresh set of processes (``rank_runner``), Accelerate's and xshard's one after the other (xshard's first in
every other repeat):

- map-style: a shuffled ``DataLoader`` over a list of samples;
- iterable: an ``IterableDataset`` generating the same samples (Accelerate slices each global batch,
  ``IterableDatasetShard``; so does xshard);
- ``--workers``: the loader's ``num_workers`` (0 and 2 by default).

Printed: the slowest rank's median microseconds per batch for each, and xshard / Accelerate (below 1:
xshard's loader costs less). Both libraries move each batch to the device (the CPU here): what remains is
the sharding, the collation and the bookkeeping each adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_runner import RESULT_ENV, run_ranks  # noqa: E402

SEQ = 64


def _sample(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"input_ids": torch.randint(0, 1000, (SEQ,), generator=g), "attention_mask": torch.ones(SEQ, dtype=torch.long)}


class Stream(torch.utils.data.IterableDataset):
    """The same samples as the map-style list, generated in order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (_sample(i) for i in range(self.n))


def worker(lib: str, kind: str, workers: int, batches: int, batch_size: int) -> None:
    """One rank: prepare the loader with ``lib`` and time the batches it yields."""
    world = int(os.environ["WORLD_SIZE"])
    n = (batches + 1) * batch_size * world
    data = Stream(n) if kind == "iterable" else [_sample(i) for i in range(n)]
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=kind == "map", num_workers=workers)
    if lib == "accelerate":
        from accelerate import Accelerator
        acc = Accelerator(cpu=True)
    else:
        from xshard import Accelerator
        acc = Accelerator(backend="cpu")
    loader = acc.prepare(loader)
    times = []
    it = iter(loader)
    next(it)  # the first batch: workers start, the order is drawn
    while True:
        start = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - start)
    Path(os.environ[RESULT_ENV]).write_text(json.dumps({"us_per_batch": statistics.median(times) * 1e6,
                                                       "batches": len(times)}))
    # each library's own end of a run: it leaves the process group (without it gloo's threads can abort the
    # interpreter's exit: "terminate called without an active exception")
    if lib == "accelerate":
        acc.end_training()
    else:
        acc.end()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker", nargs=3, metavar=("LIB", "KIND", "WORKERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        lib, kind, workers = args.worker
        worker(lib, kind, int(workers), args.batches, args.batch_size)
        return 0
    print(f"{args.world_size} ranks, {args.batches} batches of {args.batch_size} x {SEQ} tokens, "
          f"median microseconds per batch of the slowest rank")
    print("| loader | workers | Accelerate us/batch | xshard us/batch | xshard / Accelerate |")
    print("|---|---|---|---|---|")
    script = str(Path(__file__).resolve())
    common = ["--batches", str(args.batches), "--batch-size", str(args.batch_size)]
    summary = []
    for kind in ("map", "iterable"):
        for workers in args.workers:
            ratios = []
            for repeat in range(args.repeats):
                us = {}
                # the machine warms (page cache, CPU frequency) as a pair runs: who goes first alternates
                for lib in ("accelerate", "xshard")[::1 if repeat % 2 == 0 else -1]:
                    results = run_ranks([script, *common, "--worker", lib, kind, str(workers)], args.world_size)
                    us[lib] = max(r["us_per_batch"] for r in results)
                ratios.append(us["xshard"] / us["accelerate"])
                print(f"| {kind} | {workers} | {us['accelerate']:.0f} | {us['xshard']:.0f} | {ratios[-1]:.2f} |",
                      flush=True)
            summary.append((kind, workers, ratios))
    if args.repeats > 1:  # each pair of runs shares the machine's moment: the median ratio is the figure
        print("\n| loader | workers | median xshard / Accelerate | range |\n|---|---|---|---|")
        for kind, workers, ratios in summary:
            print(f"| {kind} | {workers} | {statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
