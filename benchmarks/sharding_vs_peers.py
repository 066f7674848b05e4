"""xshard's sharded core against PyTorch DDP, PyTorch FSDP2 and DeepSpeed ZeRO on CPUs (gloo).

    python benchmarks/sharding_vs_peers.py             # d=1024 (67M params) and d=512, 2 ranks
    python benchmarks/sharding_vs_peers.py --small     # d=256 and d=128, fewer steps: a quick check
    python benchmarks/sharding_vs_peers.py --sizes 1024 --configs limit ddp xshard-0

Same model (an MLP of 8 residual blocks d -> 4d -> d), same global batch (16 sequences of --seq
tokens, split over the ranks), AdamW in fp32, OMP_NUM_THREADS=1 per rank. Each configuration runs in
its own fresh set of processes, one configuration after another. DeepSpeed is optional
(``pip install deepspeed``; it runs with DS_ACCELERATOR=cpu on gloo); a peer that cannot run is
reported as skipped with the reason and the others still run.

Measured per configuration (the method is printed with the results):
- time per step: the median, over the timed steps, of the slowest rank's step time
  (zero_grad + forward + backward + optimizer step), after warm-up steps;
- model state per rank: bytes of live tensor storages at the peak of a step minus before the model
  was built (see memory_probe), and peak RSS during the timed steps;
- bytes sent per step per rank: counted by wrapping torch.distributed's functions in each process
  (see comm_count), xshard's own counter alongside; DDP's reducer works from C++, so its bytes come
  from theory (2 x parameter bytes) and are marked so;
- host time per unit per step (xshard): thread CPU time inside xshard's hooks, measured in extra
  untimed steps (``HookTimer``), divided by the units; and, derived, (step - DDP's step) / units;
- page faults per step per rank (minor: memory the process touches for the first time since the
  allocator got it from the kernel). torch's CPU allocator is glibc's malloc, which hands blocks of
  32 MiB and more straight back to the kernel when they are freed, so a tensor of that size allocated
  every step is faulted in again, 4 KiB at a time, every step. ``--rank-env`` runs every rank under
  an allocator setting to compare, e.g. ``MALLOC_MMAP_MAX_=0`` (glibc keeps freed blocks) or
  ``THP_MEM_ALLOC_ENABLE=1`` (torch asks for 2 MiB pages).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from rank_runner import RankFailure, run_ranks, write_result  # noqa: E402
from trainers import CONFIGS, THEORY_PSI, is_distributed  # noqa: E402

MIB = 2**20

#: xshard configuration -> the peers it is compared with (the best of them is "the peer")
PEERS = {"xshard-3": ["fsdp2", "ds-zero3"], "xshard-2": ["ds-zero2"], "xshard-0": ["ddp"],
         "xshard-hsdp-3": ["fsdp2-hsdp"]}
#: the configurations run by default (the hybrid ones need --world-size 4 to mean anything: add them by name)
DEFAULT_CONFIGS = [name for name in CONFIGS if "hsdp" not in name]

METHOD = (
    "step_s: median over timed steps of the slowest rank's step (zero_grad+fwd+bwd+optimizer step). "
    "cpu_s: CPU time of the whole process (all its threads) per step, median, max over ranks. "
    "faults_per_step: minor page faults of the process per timed step, median, max over ranks. "
    "state_mib: live tensor storages (gc walk, de-duplicated) at the step's peak (after backward, before "
    "the optimizer step; or after it, whichever is larger) minus before the model was built, max over ranks. "
    "rss_mib: peak RSS during the timed steps, max over ranks. sent_mb: bytes per step per rank asked of "
    "torch.distributed (all-gather = output, reduce-scatter = input, all-reduce = 2x tensor, broadcast = 1x), "
    "counted by wrapping its functions; DDP from theory (2 psi). psi = fp32 parameter bytes. "
    "hook_cpu_ms: thread CPU time per step inside xshard's hooks (module and autograd hooks, with the "
    "collectives they issue; not the time blocked waiting), measured in extra untimed steps, max over ranks; "
    "hook_cpu_us_per_unit: that divided by the sharded units (the direct per-unit host cost); "
    "over_ddp_us_per_unit: (step_s - DDP's step_s) / units, the derived figure, which also holds waits. "
    "load_avg_1m: the machine's 1-minute load average when the configuration ended (the benchmark itself "
    "accounts for about the number of ranks; more means other work shared the cores)."
)


# ---------------------------------------------------------------------------------------- host cost
#: (module, class, method): xshard's hooks, the whole of what its core runs on the host in a step
#: (each wraps the collectives it issues and waits for)
HOOKS = [("xshard.sharding.shard_engine", "ShardedEngine", m)
         for m in ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "_finish_backward",
                   "_off_forward_pre", "_off_forward_post")]
HOOKS += [("xshard.sharding.replicate", "ReplicatedEngine", m) for m in ("_pre_forward", "_on_grad", "_finish_backward")]


class HookTimer:
    """Host time inside xshard's hooks: thread CPU time and wall time of the outermost hook call.

    ``install()`` (before the model is sharded: the engines bind their hook methods then) wraps the
    methods of HOOKS; they count only while ``active`` (the extra measured steps after the timed ones,
    so the timed steps carry just a flag test per hook call). CPU time leaves out the time the host sat
    blocked in a collective's wait; wall time includes it.
    """

    def __init__(self) -> None:
        self.active = False
        self.depth = 0
        self.cpu_s = self.wall_s = 0.0
        self.calls = 0
        self.units = 0  # of the sharded engine whose hooks ran (0 at stage 0)

    def install(self) -> None:
        import importlib

        for module_name, class_name, method in HOOKS:
            cls = getattr(importlib.import_module(module_name), class_name)
            setattr(cls, method, self._wrap(getattr(cls, method)))

    def _wrap(self, fn):
        import functools

        @functools.wraps(fn)
        def timed(engine, *args, **kwargs):
            if not self.active or self.depth:
                return fn(engine, *args, **kwargs)
            self.depth += 1
            self.units = max(self.units, len(getattr(engine, "units", ())))
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - cpu
                self.wall_s += time.perf_counter() - wall
                self.calls += 1
                self.depth -= 1

        return timed


# ---------------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration: build, warm up, time, probe memory, write the result."""
    import comm_count

    comm_count.install()  # before any framework keeps references to torch.distributed's functions
    import memory_probe
    import torch.distributed as dist
    from mlp import make_batch, make_model
    from trainers import build

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    batch = make_batch(args.batch, args.seq, args.d, rank, args.world_size)
    live_before = memory_probe.live_tensor_bytes()
    rss_before = memory_probe.rss_bytes()
    model = make_model(args.d, args.blocks)
    numel = sum(p.numel() for p in model.parameters())
    if args.gloo_reduce_scatter != "backend":  # the CPU backend's reduce-scatter form, for comparing them
        from xshard.backends.devices.cpu import CPUBackend

        options = {**CPUBackend().collective_options(), "reduce_scatter_form": args.gloo_reduce_scatter}
        CPUBackend.collective_options = lambda self: options
    hooks = HookTimer()
    if args.worker.startswith("xshard"):
        hooks.install()
    trainer = build(args.worker, model, batch, args.world_size, parse_options(args.xshard_opt), args.nodes)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    times, fb_times, cpu_times, faults = [], [], [], []
    for i in range(args.warmup + args.steps):
        barrier()
        if i == args.warmup:
            memory_probe.reset_peak_rss()
        comm_count.reset()
        trainer.reset_own_comm()
        start, cpu_start = time.perf_counter(), time.process_time()
        faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        trainer.zero_grad()
        trainer.forward_backward()
        mid = time.perf_counter()
        trainer.optimizer_step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            fb_times.append(mid - start)
            cpu_times.append(time.process_time() - cpu_start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start)
    counted, own_comm = comm_count.snapshot(), trainer.own_comm()
    rss_peak = memory_probe.peak_rss_bytes()

    barrier()  # one more step, untimed, to probe memory at its peak
    trainer.zero_grad()
    trainer.forward_backward()
    live_mid = memory_probe.live_tensor_bytes()
    trainer.optimizer_step()
    live_end = memory_probe.live_tensor_bytes()
    host = host_steps(trainer, barrier, hooks, args.steps) if args.worker.startswith("xshard") else None
    phases = phase_step(trainer, barrier) if args.profile and args.worker.startswith("xshard") else None
    profile = profile_step(trainer, barrier, record=rank == 0) if args.profile else None
    write_result({
        "rank": rank, "numel": numel, "step_s": times, "fwd_bwd_s": fb_times, "cpu_s": cpu_times,
        "minor_faults": faults, "phases": phases, "counted": counted, "own_comm": own_comm,
        "own_state": trainer.own_state(), "comm_seen_from_python": trainer.comm_seen_from_python,
        "state_bytes": max(live_mid, live_end) - live_before,
        "rss_before": rss_before, "rss_peak": rss_peak, "profile": profile, "host": host,
    })
    barrier()
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def parse_options(pairs: list[str]) -> dict:
    """``["forward_prefetch=true", "bucket_size_mb=50"]`` -> ShardingOptions keywords (values as JSON when they parse)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--xshard-opt expects KEY=VALUE (a ShardingOptions field), got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def host_steps(trainer, barrier, hooks: HookTimer, steps: int) -> dict:
    """``steps`` more steps (untimed) with the host time inside xshard's hooks measured, per step."""
    hooks.active = True
    for _ in range(steps):
        barrier()
        trainer.zero_grad()
        trainer.forward_backward()
        trainer.optimizer_step()
    hooks.active = False
    return {"hook_cpu_s": hooks.cpu_s / steps, "hook_wall_s": hooks.wall_s / steps,
            "hook_calls": hooks.calls / steps, "units": hooks.units}


def phase_step(trainer, barrier) -> dict:
    """One more step with xshard's phases timed (see xshard_phases); compute is the remainder."""
    import xshard_phases

    missing = xshard_phases.install()
    barrier()
    xshard_phases.reset()
    start, cpu_start = time.perf_counter(), time.thread_time()
    trainer.zero_grad()
    trainer.forward_backward()
    mid, cpu_mid = time.perf_counter(), time.thread_time()
    trainer.optimizer_step()
    end = time.perf_counter()
    phases = xshard_phases.report()
    return {
        "step_s": round(end - start, 4), "optimizer_step_s": round(end - mid, 4),
        "fwd_bwd_rest_s": round(mid - start - sum(v["s"] for v in phases.values()), 4),
        "fwd_bwd_rest_cpu_s": round(cpu_mid - cpu_start - sum(v["cpu_s"] for v in phases.values()), 4),
        "phases": phases, "not_found": missing,
    }


def profile_step(trainer, barrier, record: bool = True) -> str | None:
    """One more step under torch.profiler (on one rank; the others run the step unprofiled)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    barrier()
    if not record:
        trainer.zero_grad()
        trainer.forward_backward()
        trainer.optimizer_step()
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.zero_grad()
        with record_function("## forward+backward"):
            trainer.forward_backward()
        with record_function("## optimizer step"):
            trainer.optimizer_step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


# ---------------------------------------------------------------------------------------- driver
def unavailable_reason(name: str) -> str | None:
    """Why a configuration cannot run here, or None."""
    if name.startswith("ds-") and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed: pip install deepspeed"
    if name.startswith("fsdp2"):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2): torch >= 2.6"
    if name.startswith("xshard"):
        try:
            from xshard.sharding import shard_model  # noqa: F401
        except ImportError as exc:
            return f"xshard.sharding cannot be imported: {exc}"
    return None


def summarise(name: str, d: int, per_rank: list[dict]) -> dict:
    """One configuration's figures from its ranks' results."""
    first = per_rank[0]
    psi = 4 * first["numel"]
    steps = [max(r["step_s"][i] for r in per_rank) for i in range(len(first["step_s"]))]
    row = {
        "config": name, "d": d, "params": first["numel"], "ranks": len(per_rank),
        "step_s": round(statistics.median(steps), 3),
        "step_s_range": [round(min(steps), 3), round(max(steps), 3)],
        "fwd_bwd_s": round(statistics.median(
            max(r["fwd_bwd_s"][i] for r in per_rank) for i in range(len(first["fwd_bwd_s"]))), 3),
        "cpu_s": round(max(statistics.median(r["cpu_s"]) for r in per_rank), 3),
        "faults_per_step": max(int(statistics.median(r["minor_faults"])) for r in per_rank),
        "state_mib": round(max(r["state_bytes"] for r in per_rank) / MIB, 1),
        "rss_mib": round(max(r["rss_peak"] or 0 for r in per_rank) / MIB, 1),
        "rss_growth_mib": round(max((r["rss_peak"] or 0) - (r["rss_before"] or 0) for r in per_rank) / MIB, 1),
    }
    if first.get("host"):
        hosts = [r["host"] for r in per_rank]
        row["hook_cpu_ms"] = round(1000 * max(h["hook_cpu_s"] for h in hosts), 2)
        row["hook_wall_ms"] = round(1000 * max(h["hook_wall_s"] for h in hosts), 2)
        row["units"] = first["host"]["units"]
        if row["units"]:
            row["hook_cpu_us_per_unit"] = round(1e6 * max(h["hook_cpu_s"] for h in hosts) / row["units"], 1)
    if not is_distributed(name):
        return row
    if first["comm_seen_from_python"]:
        sent = max(sum(r["counted"]["bytes"].values()) for r in per_rank)
        row.update(sent_mb=round(sent / 1e6, 1), sent_source="counted",
                   sent_by_op={k: round(v / 1e6, 1) for k, v in first["counted"]["bytes"].items()})
    else:
        sent = THEORY_PSI[name] * psi
        row.update(sent_mb=round(sent / 1e6, 1), sent_source="theory")
    row["sent_psi"] = round(sent / psi, 2)
    if first["own_comm"] is not None:
        own = sum(first["own_comm"]["bytes"].values())
        row.update(own_sent_mb=round(own / 1e6, 1), own_sent_psi=round(own / psi, 2),
                   own_sent_by_kind={k: round(v / 1e6, 1) for k, v in first["own_comm"]["bytes"].items()})
    if first["own_state"] is not None:
        row["own_state_mib"] = {k: round(v / MIB, 1) for k, v in first["own_state"].items()
                                if isinstance(v, (int, float))}
    return row


def add_ratios(rows: dict[str, dict]) -> None:
    """Ratios to the baselines of the same run: compute limit, DDP, and each xshard stage's best peer."""
    for name, row in rows.items():
        if "step_s" not in row:
            continue
        for base in ("limit", "ddp"):
            if base != name and "step_s" in rows.get(base, {}):
                row[f"x_{base}"] = round(row["step_s"] / rows[base]["step_s"], 2)
        if row.get("units") and "step_s" in rows.get("ddp", {}):  # the step's excess over DDP's, per unit
            row["over_ddp_us_per_unit"] = round(1e6 * (row["step_s"] - rows["ddp"]["step_s"]) / row["units"], 1)
        peers = [rows[p] for p in PEERS.get(name, []) if "step_s" in rows.get(p, {})]
        if peers:
            best = min(peers, key=lambda r: r["step_s"])
            row["peer"] = best["config"]
            row["x_peer"] = round(row["step_s"] / best["step_s"], 2)
            row["state_x_peer"] = round(row["state_mib"] / best["state_mib"], 2)


def print_table(d: int, rows: dict[str, dict]) -> None:
    """A markdown table for one model size."""
    head = ["config", "s/step", "CPU s/step", "page faults/step (k)", "x limit", "x DDP", "x best peer", "state MiB/rank", "peak RSS MiB/rank",
            "MB sent/step/rank", "sent / psi", "hooks CPU ms/step", "host us/unit/step: hooks CPU; (step - DDP)",
            "load (1 min)"]
    numel = next((r["params"] for r in rows.values() if "params" in r), 0)
    print(f"\nd={d}, {numel / 1e6:.1f}M parameters")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in rows.items():
        if "step_s" not in r:
            print(f"| {name} | {r.get('skipped') or 'failed'} |" + " |" * (len(head) - 2))
            continue
        peer = f"{r['x_peer']:.2f} ({r['peer']})" if "x_peer" in r else ""
        sent = ""
        if "sent_mb" in r:
            sent = f"{r['sent_mb']:.0f}" + (" (theory)" if r["sent_source"] == "theory" else "")
            if "own_sent_mb" in r:
                sent += f"; own counter {r['own_sent_mb']:.0f}"
        psi = f"{r['sent_psi']:.2f}" if "sent_psi" in r else ""
        per_unit = ""
        if "hook_cpu_us_per_unit" in r:
            per_unit = f"{r['hook_cpu_us_per_unit']:.0f}" + (
                f"; ({r['over_ddp_us_per_unit']:.0f})" if "over_ddp_us_per_unit" in r else "")
        cells = [name, f"{r['step_s']:.3f}", f"{r['cpu_s']:.3f}", f"{r['faults_per_step'] / 1000:.0f}",
                 f"{r['x_limit']:.2f}" if "x_limit" in r else ("1.00" if name == "limit" else ""),
                 f"{r['x_ddp']:.2f}" if "x_ddp" in r else "", peer, f"{r['state_mib']:.0f}",
                 f"{r['rss_mib']:.0f}", sent, psi, f"{r['hook_cpu_ms']:.1f}" if "hook_cpu_ms" in r else "",
                 per_unit, str(r.get("load_avg_1m", ""))]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", help="model widths d (default 1024 512; --small: 256 128)")
    parser.add_argument("--small", action="store_true", help="a quick run: d=256 and 128, 1 warm-up, 3 steps")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="NAME",
                        help=f"which configurations, in order (default: {' '.join(DEFAULT_CONFIGS)}; also "
                             f"{' '.join(c for c in CONFIGS if c not in DEFAULT_CONFIGS)})")
    parser.add_argument("--nodes", type=int, default=2,
                        help="simulated nodes of the hybrid configurations (*-hsdp*): sharded within each "
                             "of --nodes groups of consecutive ranks, replicated across them (default 2)")
    parser.add_argument("--gloo-reduce-scatter", choices=("backend", "all_reduce", "reduce", "exchange"), default="backend",
                        help="the reduce-scatter form xshard uses on gloo: the CPU backend's choice (default), "
                             "an all-reduce plus a slice, one reduce per rank, or a point-to-point exchange")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), split over the ranks")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--xshard-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="a ShardingOptions field for the xshard configurations (repeatable), "
                             "e.g. forward_prefetch=true")
    parser.add_argument("--rank-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for every rank of every configuration (repeatable), "
                             "e.g. MALLOC_MMAP_MAX_=0 to compare allocator settings")
    parser.add_argument("--profile", action="store_true",
                        help="profile one extra step on rank 0 with torch.profiler and print its top operators")
    parser.add_argument("--d", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; valid: {', '.join(CONFIGS)}")
    if args.world_size < 2 or args.batch % args.world_size:
        parser.error("--world-size must be >= 2 and divide --batch")
    if any("hsdp" in c for c in args.configs) and (args.nodes < 2 or args.world_size % args.nodes):
        parser.error(f"the hybrid configurations need --nodes >= 2 dividing --world-size {args.world_size} "
                     "(e.g. --world-size 4 --nodes 2)")
    try:
        from xshard.sharding import ShardingOptions

        ShardingOptions(**parse_options(args.xshard_opt)).validate()
    except ImportError:
        pass  # the xshard rows will say why they are skipped
    except (TypeError, ValueError) as exc:
        parser.error(f"--xshard-opt: {exc}")
    if any("=" not in pair for pair in args.rank_env):
        parser.error("--rank-env takes KEY=VALUE")
    rank_env = dict(pair.split("=", 1) for pair in args.rank_env)
    sizes = args.sizes or ([256, 128] if args.small else [1024, 512])
    warmup = args.warmup if args.warmup is not None else (1 if args.small else 2)
    steps = args.steps if args.steps is not None else (3 if args.small else 5)

    print(f"# sharding_vs_peers {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores, {args.world_size} ranks on gloo, OMP_NUM_THREADS=1, "
          f"batch {args.batch}x{args.seq}, {args.blocks} blocks, AdamW fp32, {warmup} warm-up + {steps} timed steps"
          + (f", hybrid configurations on {args.nodes} simulated nodes" if any("hsdp" in c for c in args.configs)
             else "")
          + (f", gloo reduce-scatter via {args.gloo_reduce_scatter}" if args.gloo_reduce_scatter != "backend" else "")
          + (f", xshard options {parse_options(args.xshard_opt)}" if args.xshard_opt else "")
          + (f", every rank with {' '.join(args.rank_env)}" if args.rank_env else ""))
    print(f"# method: {METHOD}")
    for d in sizes:
        rows: dict[str, dict] = {}
        for name in args.configs:
            reason = unavailable_reason(name)
            if reason:
                rows[name] = {"config": name, "d": d, "skipped": reason}
                print(json.dumps(rows[name]), flush=True)
                continue
            cmd = [os.path.abspath(__file__), "--worker", name, "--d", str(d), "--blocks", str(args.blocks),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--world-size", str(args.world_size),
                   "--warmup", str(warmup), "--steps", str(steps), "--nodes", str(args.nodes),
                   "--gloo-reduce-scatter", args.gloo_reduce_scatter] + (["--profile"] if args.profile else [])
            cmd += [f"--xshard-opt={o}" for o in args.xshard_opt]
            try:
                per_rank = run_ranks(cmd, args.world_size if is_distributed(name) else 1,
                                     env={"DS_ACCELERATOR": "cpu", **rank_env})
            except RankFailure as exc:
                rows[name] = {"config": name, "d": d, "failed": str(exc).splitlines()[-1][:300]}
                print(json.dumps(rows[name]), flush=True)
                print(f"  {name}: {exc}", file=sys.stderr)
                continue
            rows[name] = summarise(name, d, per_rank)
            rows[name]["load_avg_1m"] = round(os.getloadavg()[0], 1)  # > 0.2 x cores: others shared the machine
            print(f"  d={d} {name}: {rows[name]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
            if per_rank[0].get("phases"):
                print(f"\n## xshard phases of one step, rank 0, {name}, d={d}: "
                      f"{json.dumps(per_rank[0]['phases'], indent=1)}", flush=True)
            if per_rank[0].get("profile"):
                print(f"\n## profile of one step, rank 0, {name}, d={d}\n{per_rank[0]['profile']}", flush=True)
        add_ratios(rows)
        for name in args.configs:
            if "step_s" in rows[name]:
                print(json.dumps(rows[name]), flush=True)
        print_table(d, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
