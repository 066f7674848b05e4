"""Training stall per checkpoint: blocking save_state vs async_save=True vs torch.distributed.checkpoint.async_save.

    python benchmarks/async_save.py                  # 302M parameters (18 x 4096^2), 2 ranks, stage 3, AdamW
    python benchmarks/async_save.py --layers 4 --width 1024 --steps 4     # a quick look (4M parameters)

Starts 2 gloo ranks (`xshard launch --nproc 2`). Each rank trains a stack of bias-free Linear layers
at stage 3 with AdamW and measures, per way of saving, what one checkpoint costs the training loop:

    stall = (time of the save call + the steps after it + the wait before the next save)
            - (the same number of steps without a save, timed right before it)

so the stall of an async save counts its copy to host memory, the steps slowed by the background
write sharing the CPU, and whatever is left to wait for. The first async save also allocates its host
buffers; the later ones reuse them (each save's figures are printed, then the median). The steps
without a save are timed right before each save, so that a machine whose load drifts (a shared one)
moves both sides of the difference alike. Every save writes the "sharded" checkpoint
(each rank its own rows of the model and the optimizer state, with fsync), so the ranks write in
parallel. torch.distributed.checkpoint (DCP) saves the same tensors (this rank's parameter rows and
AdamW moments, keys prefixed by rank) with its own async_save.

Host memory: the bytes of host buffers the async save allocated on each rank against the theory (one
copy of the bytes this rank writes), and each rank's resident set size before and after the first
async save. Also: how long xshard's background write took on each rank (from the call's return to its
files, and on rank 0 the commit, being done) and the CPU seconds its thread used (user and system: on a
machine whose cores the training keeps busy, roughly what the write takes from the steps beside it),
the training thread's CPU seconds in each save call, and the machine's 1-minute load average before and
after each way of saving (on a shared machine the ratios move with it). Prints one JSON line per rank
and a table from rank 0, with the time of each step timed before and after each save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_main(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import xshard
    from xshard.checkpoint.save_load import wait_for_background_save

    torch.set_num_threads(1)
    acc = xshard.Accelerator(config={"stage": 3, "state_dict_type": "sharded", "auto_wrap_policy": "size",
                                     "min_num_params": args.width * args.width}, seed=0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(args.batch, args.width)

    def step() -> None:
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    def timed_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times

    timed_steps(2)  # warm-up: optimizer state exists from here on
    base = statistics.median(timed_steps(args.steps))
    out = Path(args.out)
    results: dict[str, dict[str, float]] = {}

    def measure(name: str, save, wait) -> None:
        stalls, calls, call_cpus, writes, write_cpus, steps_before, steps_after = [], [], [], [], [], [], []
        load_before = os.getloadavg()[0]
        for i in range(args.repeats):
            acc.wait_for_everyone()
            before = timed_steps(args.steps)
            acc.wait_for_everyone()
            start, cpu_start = time.perf_counter(), time.thread_time()
            save(out / f"{name}-{i}")
            called = time.perf_counter() - start
            call_cpus.append(time.thread_time() - cpu_start)
            after = timed_steps(args.steps)
            wait()
            total = time.perf_counter() - start
            stalls.append(total - sum(before))
            calls.append(called)
            steps_before.append(before)
            steps_after.append(after)
            if name == "xshard_async":
                writes.append(acc.job.async_saver.write_seconds)
                write_cpus.append(acc.job.async_saver.write_cpu_seconds)
        results[name] = {"stall_s": statistics.median(stalls), "call_s": statistics.median(calls),
                         "stalls_s": stalls, "calls_s": calls, "call_cpu_s": call_cpus, "writes_s": writes,
                         "write_cpu_s": write_cpus,
                         "steps_before_s": steps_before, "steps_after_s": steps_after,
                         "load": [load_before, os.getloadavg()[0]]}

    rss_before = _rss()
    measure("blocking", lambda p: acc.save_state(p), lambda: None)
    measure("xshard_async", lambda p: acc.save_state(p, async_save=True), lambda: wait_for_background_save(acc.job))
    rss_after = _rss()
    saver = acc.job.async_saver
    # theory: one host copy of what this rank writes (its rows of every parameter and of both AdamW moments)
    rows = sum(p.numel() * p.element_size() for p in opt.param_groups[0]["params"])
    theory = 3 * rows

    dcp = "not run"
    try:
        import torch.distributed.checkpoint as dist_cp

        def dcp_state() -> dict[str, torch.Tensor]:
            state = {}
            for i, p in enumerate(opt.param_groups[0]["params"]):
                state[f"rank{acc.process_index}.param{i}"] = p.detach()
                for key in ("exp_avg", "exp_avg_sq"):
                    state[f"rank{acc.process_index}.{key}{i}"] = opt.state[p][key]
            return state

        # DCP's background thread runs collectives of its own: on the training loop's group they would
        # interleave with the loop's, so it gets a group of its own (as DCP's documentation advises)
        group = torch.distributed.new_group(backend="gloo")
        pending: list = []
        measure("dcp_async", lambda p: pending.append(dist_cp.async_save(dcp_state(), checkpoint_id=str(p),
                                                                          process_group=group)),
                lambda: pending.pop().result())
        dcp = "ok"
    except Exception as exc:  # report why it does not run here instead of failing the whole benchmark
        dcp = f"{type(exc).__name__}: {exc}"

    record = {"rank": acc.process_index, "params": params, "step_s": base, "results": results,
              "host_buffers_bytes": saver.staging.bytes_allocated, "theory_bytes": theory,
              "rss_added_bytes": rss_after - rss_before, "dcp": dcp}
    os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())  # one write: the ranks' lines stay whole
    acc.end()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="steps timed after each save")
    parser.add_argument("--repeats", type=int, default=2, help="saves per way of saving (median)")
    parser.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory(dir=args.out) as out:
        argv = [sys.executable, "-m", "xshard", "launch", "--nproc", "2", __file__, "--rank", "--out", out,
                "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
                "--steps", str(args.steps), "--repeats", str(args.repeats)]
        env = {**os.environ, "XSHARD_BACKEND": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
    records = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or len(records) != 2:
        sys.exit(f"benchmark failed ({done.returncode}):\n{done.stderr[-4000:]}")
    first = records[0]
    print(f"model {first['params'] / 1e6:.0f}M parameters, 2 ranks, stage 3, AdamW, 'sharded' checkpoints; "
          f"median step {first['step_s']:.2f} s")
    print(f"{'save':<14}{'save call (s)':<18}{'call / blocking':<17}{'stall (s), per rank':<24}{'stall / blocking':<18}"
          "load (1 min) before, after")
    for name in records[0]["results"]:
        stalls = [r["results"][name]["stall_s"] for r in records]
        calls = [r["results"][name]["call_s"] for r in records]
        call_ratio = max(calls) / max(r["results"]["blocking"]["call_s"] for r in records)
        ratio = max(stalls) / max(r["results"]["blocking"]["stall_s"] for r in records)
        load = records[0]["results"][name]["load"]
        print(f"{name:<14}{' / '.join(f'{c:.2f}' for c in calls):<18}{call_ratio:<17.2f}"
              f"{' / '.join(f'{s:.2f}' for s in stalls):<24}{ratio:<18.2f}{load[0]:.1f}, {load[1]:.1f}")
    for name in records[0]["results"]:
        for r in records:
            res = r["results"][name]
            writes = (f"; background write (s) {', '.join(f'{w:.2f}' for w in res['writes_s'])} "
                      f"(its thread's CPU s {', '.join(f'{w:.2f}' for w in res['write_cpu_s'])})") if res["writes_s"] else ""
            print(f"  {name} rank {r['rank']}, each save: call (s) {', '.join(f'{c:.2f}' for c in res['calls_s'])} "
                  f"(the training thread's CPU s {', '.join(f'{c:.2f}' for c in res['call_cpu_s'])}); "
                  f"stall (s) {', '.join(f'{s:.2f}' for s in res['stalls_s'])}{writes}")
            for before, after in zip(res["steps_before_s"], res["steps_after_s"], strict=True):  # where the stall went
                print(f"    steps (s) before the save {' '.join(f'{t:.2f}' for t in before)}; "
                      f"after it {' '.join(f'{t:.2f}' for t in after)}")
    for r in records:
        print(f"rank {r['rank']}: async host buffers {r['host_buffers_bytes'] / 1e9:.2f} GB (theory {r['theory_bytes'] / 1e9:.2f}"
              f" GB), RSS added {r['rss_added_bytes'] / 1e9:.2f} GB; DCP: {r['dcp']}")


if __name__ == "__main__":
    main()
