"""Estimate the memory each device needs to train a model: model states by ZeRO stage, transients, activations.

    xshard estimate --model ./qwen1.5_7b_chat --nproc 8 --stage 3 --device-memory 64GB
    xshard estimate --model config.json --nproc 8            # all four stages side by side
    xshard estimate --model ./model --nproc 8 --stage 2 --offload --grad-ckpt --json
    xshard estimate --model ./model --nproc 64 --stage 3 --seq-len 8192 --machine h100   # and the step time

The parameter count comes from the folder's .safetensors headers (no weights are loaded) or from the
config.json values. Sizes are in GB (10^9 bytes), per device; "host" is CPU memory per process.
With --stage and --device-memory the exit status says whether the run fits (0) or not (1).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from xshard.estimate import (
    GB,
    MB,
    PRECISIONS,
    USABLE_FRACTION,
    EstimateError,
    MemoryEstimate,
    ModelSize,
    estimate_memory,
    estimate_to_dict,
    load_model_size,
    parse_memory,
    parse_stage,
)
from xshard.sharding.plan import ShardingPlan
from xshard.step_time import COMM_EFFICIENCY, DEFAULT_MFU, MACHINES, StepTime, predict

ROWS = [("parameters", "params"), ("gradients", "grads"), ("optimizer states", "optimizer"),
        ("gathered units (transient)", "gathered"), ("activations", "activations"), ("total per device", "total"),
        ("host memory per process", "host")]


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Turn an EstimateError from a parser into argparse's "argument --x: invalid value" message."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except EstimateError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `xshard estimate`."""
    parser.add_argument("--model", required=True, help="model folder (config.json, *.safetensors) or a config.json")
    parser.add_argument("--nproc", type=int, default=1, help="data-parallel processes (devices) in the job")
    parser.add_argument("--stage", type=_typed(parse_stage), default=None,
                        help="ZeRO stage 0-3 or NO_SHARD/SHARD_GRAD_OP/FULL_SHARD (default: show all)")
    parser.add_argument("--dtype", choices=list(PRECISIONS), default="bf16",
                        help="bf16/fp16: mixed precision with fp32 Adam master (K=12); fp32: all fp32 (16 bytes)")
    parser.add_argument("--offload", action="store_true",
                        help="optimizer states and gradient/parameter shards on the host (stages 1-3)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per device per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of every decoder layer")
    parser.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa",
                        help="sdpa: fused attention, no seq x seq matrices kept; eager: they are kept")
    parser.add_argument("--device-memory", type=_typed(parse_memory), default=None,
                        help="memory of one device, e.g. 64GB or 80GiB: say whether the run fits")
    parser.add_argument("--machine", choices=sorted(MACHINES), default=None,
                        help="predict the step time on these machines (peak, links: xshard.step_time.MACHINES, with "
                             "their sources); --nproc devices over as many nodes as that takes")
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                        help=f"the fraction of the peak the model's compute reaches (default {DEFAULT_MFU}; "
                             "accelerator.throughput() measures yours)")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")


def _header(size: ModelSize, args: argparse.Namespace) -> str:
    precision = PRECISIONS[args.dtype]
    mode = ("fp32 training with Adam" if args.dtype == "fp32" else f"{args.dtype} mixed precision with fp32 Adam master")
    return (f"{size.architecture} ({size.model_type}): {_count(size.total_params)} parameters "
            f"({size.total_params:,}; from {size.source})\n"
            f"{args.nproc} processes, {mode} (K={precision.optimizer_bytes}),\nmicro-batch {args.micro_batch} x "
            f"{args.seq_len} tokens, {args.attention} attention, "
            f"{'activation checkpointing' if args.grad_ckpt else 'no activation checkpointing'}"
            f"{', offload to host' if args.offload else ''}.")


def _count(n: int) -> str:
    """7721324544 -> '7.72B', 164928 -> '164.9K'."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if suffix == 'B' else 1}f}{suffix}"
    return str(n)


def _table(estimates: list[MemoryEstimate]) -> str:
    scale, unit = (GB, "GB (10^9 bytes)") if max(e.total for e in estimates) >= GB else (MB, "MB (10^6 bytes)")
    width = max(len(label) for label, _ in ROWS) + 2
    lines = [f"{unit:<{width}}" + "".join(f"{'stage ' + str(e.stage):>10}" for e in estimates)]
    for label, field in ROWS:
        lines.append(f"{label:<{width}}" + "".join(f"{getattr(e, field) / scale:>10.2f}" for e in estimates))
    memory = estimates[0].device_memory
    if memory is not None:
        label = f"fits {memory / GB:.1f} GB"
        lines.append(f"{label:<{width}}" + "".join(f"{'yes' if e.fits else 'no':>10}" for e in estimates))
        lines.append(f"(a run fits when its estimate is at most {USABLE_FRACTION:.0%} of the device memory: "
                     "runtime context, workspaces and fragmentation take the rest)")
    return "\n".join(lines)


def _time_table(args: argparse.Namespace, estimates: list[MemoryEstimate], times: list[StepTime]) -> str:
    machine = MACHINES[args.machine]
    nodes = -(-args.nproc // machine.devices_per_node)
    width = max(len(label) for label, _ in ROWS) + 2
    lines = [f"\nstep time on {args.nproc} {args.machine} device(s), {nodes} node(s) ({machine.source}); "
             f"MFU {args.mfu:.2f} assumed, links at {COMM_EFFICIENCY:.0%} of their speed; "
             f"{times[0].flops_per_token / 1e9:.1f} GFLOPs a token (6N + 12*L*d*s)",
             f"{'seconds':<{width}}" + "".join(f"{'stage ' + str(e.stage):>10}" for e in estimates)]
    for label, value in (("compute", lambda t: f"{t.compute_s:.3f}"), ("communication", lambda t: f"{t.comm_s:.3f}"),
                         ("step (overlapped)", lambda t: f"{t.step_s:.3f}"),
                         ("tokens/s per device", lambda t: f"{t.tokens_per_s_per_device:,.0f}"),
                         ("bound by", lambda t: t.bound[:7] if t.bound == "compute" else "comm")):
        lines.append(f"{label:<{width}}" + "".join(f"{value(t):>10}" for t in times))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the estimate. Exit status 0, or 1 when --stage and --device-memory are given and it does not fit."""
    size = load_model_size(args.model)
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    if args.offload:  # only stages that shard have shards to offload (stage 0 alone: let it raise below)
        stages = [s for s in stages if ShardingPlan.for_stage(s).shard_parameters] or stages
    estimates = [
        estimate_memory(size, args.nproc, stage, args.dtype, args.offload, args.micro_batch, args.seq_len,
                        args.grad_ckpt, args.attention, args.device_memory)
        for stage in stages
    ]
    times = [] if args.machine is None else [
        predict(size, e.stage, args.nproc, MACHINES[args.machine], micro_batch=args.micro_batch, seq_len=args.seq_len,
                dtype=args.dtype, mfu=args.mfu) for e in estimates]
    if args.json:
        settings = {k: getattr(args, k) for k in ("nproc", "dtype", "offload", "micro_batch", "seq_len", "grad_ckpt",
                                                  "attention", "device_memory", "machine", "mfu")}
        out = estimate_to_dict(size, estimates, settings)
        if times:
            out["step_time"] = [{"stage": e.stage, "compute_s": t.compute_s, "comm_s": t.comm_s, "step_s": t.step_s,
                                 "tokens_per_s_per_device": t.tokens_per_s_per_device, "bound": t.bound,
                                 "comm_bytes_per_device": t.comm_bytes_per_device,
                                 "flops_per_token": t.flops_per_token} for e, t in zip(estimates, times, strict=True)]
        print(json.dumps(out, indent=2))
    else:
        print(_header(size, args))
        print(_table(estimates))
        if times:
            print(_time_table(args, estimates, times))
    return 1 if args.stage is not None and estimates[0].fits is False else 0
