"""The device check: one command that measures xshard on one GPU or NPU (or, small, on the CPU).

    python benchmarks/device_check.py                         # one CUDA GPU: about 8 minutes
    python benchmarks/device_check.py --device npu            # one Ascend NPU (torch_npu)
    python benchmarks/device_check.py --device cpu --quick    # the same code paths, small: about a minute
    python benchmarks/device_check.py --compile               # also torch.compile in the speed part

Parts (each in its own try block with a time budget; one that fails or runs out of time is recorded and
the others still run): correctness (xshard stages 0 and 3 against plain PyTorch on the same device, fp32
and bf16 autocast, activation checkpointing, CPU offload), host syncs from xshard's code, speed of a
Qwen2-shaped model (plain PyTorch, xshard 0 and 3, FSDP2, Accelerate), the stall of an async save
against a blocking one, and CPU offload's step time. Writes ``report.json`` and ``report.md`` to ``--out``.
Each configuration runs in its own process (a fresh device context and memory); ``--quick`` runs a
part's configurations one after another in one process, so that the CPU form's process start-ups stay few.
The workers are ``device_check_workers.py``, their probes (syncs, profiler) ``device_check_probes.py``;
``benchmarks/README.md`` says what each part measures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # xshard from this checkout where it is not installed (a device machine)
from rank_runner import RankFailure, run_ranks, write_result  # noqa: E402

DEVICES = ("cuda", "npu", "cpu")
#: seconds each part may take on an accelerator (under 8 minutes in all), and in --quick (caps, not expectations:
#: the CPU form takes about a minute on 2 cores; a shared machine's load may stretch it)
BUDGETS = {"correctness": 100, "syncs": 45, "speed": 210, "async_save": 60, "offload": 50}
QUICK_BUDGETS = {"correctness": 50, "syncs": 25, "speed": 70, "async_save": 30, "offload": 25}
#: the speed part's model: about 1B parameters on an accelerator (Qwen2 shapes: GQA, tied embeddings)
FULL_MODEL = {"hidden": 2048, "layers": 16, "heads": 16, "kv_heads": 8, "intermediate": 5632, "vocab": 151936}
QUICK_MODEL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}


class BadInput(Exception):
    """A problem with the command line or the machine, said in one line (exit code 2)."""


# ------------------------------------------------------------------------------------------- the machine
def device_facts(device: str) -> dict[str, Any]:
    """The device's name, count, memory free and the software versions; BadInput where it is absent."""
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                             "host": platform.node(), "cpu_cores": os.cpu_count()}
    if device == "cpu":
        with open("/proc/meminfo") as f:
            free_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return {**facts, "device": f"CPU ({platform.processor() or platform.machine()})", "count": 1,
                "free_bytes": free_kib * 1024}
    if device == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise BadInput("--device npu: torch_npu is not installed; on a machine without an NPU run the CPU form: "
                           "python benchmarks/device_check.py --device cpu --quick")
        import torch_npu

        facts.update(torch_npu=torch_npu.__version__, cann=_cann_version())
    module = getattr(torch, device)
    if not module.is_available() or module.device_count() == 0:
        raise BadInput(f"--device {device}: no {device.upper()} device is visible to torch {torch.__version__}; "
                       "on a machine without one run the CPU form: python benchmarks/device_check.py --device cpu --quick")
    free, _total = module.mem_get_info(0)
    if device == "cuda":
        facts.update(cuda=torch.version.cuda, driver=_nvidia_driver())
    return {**facts, "device": module.get_device_name(0), "count": module.device_count(), "free_bytes": free}


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def _cann_version() -> str:
    for path in ("/usr/local/Ascend/ascend-toolkit/latest/version.cfg",
                 "/usr/local/Ascend/ascend-toolkit/latest/compiler/version.info"):
        if os.path.exists(path):
            return Path(path).read_text().strip().splitlines()[0]
    return "unknown"


def peak_tflops(facts: dict[str, Any], device: str) -> dict[str, Any]:
    """The device's bf16 peak from xshard's table (on the CPU: xshard's matmul probe)."""
    import torch

    from xshard.runtime.throughput import peak_flops

    measure = None
    if device == "cpu":
        from xshard.backends.devices.cpu import CPUBackend

        def measure() -> float | None:
            return CPUBackend().measured_peak_tflops(torch.bfloat16)

    peak = peak_flops(facts["device"], torch.bfloat16, measure=measure)
    return {"tflops": peak.tflops, "source": peak.source}


def check_fits(spec: dict[str, Any], free_bytes: int) -> dict[str, Any]:
    """xshard's estimate of the speed part's model at stage 0 (the largest need) against the free memory."""
    from xshard.estimate import EstimateError

    m = spec["model"]
    if m["hidden"] % m["heads"] or m["heads"] % m["kv_heads"]:
        raise BadInput(f"--hidden {m['hidden']} does not split into {m['heads']} attention heads "
                       f"({m['kv_heads']} key-value heads): give a multiple of {m['heads']}")
    try:
        return _fits(m, spec, free_bytes)
    except EstimateError as exc:
        raise BadInput(f"the speed model cannot be estimated: {exc}") from None


def _fits(m: dict[str, Any], spec: dict[str, Any], free_bytes: int) -> dict[str, Any]:
    from xshard.estimate import estimate_memory, model_size_from_config

    size = model_size_from_config({
        "model_type": "qwen2", "hidden_size": m["hidden"], "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"], "num_key_value_heads": m["kv_heads"],
        "intermediate_size": m["intermediate"], "vocab_size": m["vocab"], "tie_word_embeddings": True})
    need = estimate_memory(size, 1, 0, "bf16", micro_batch=spec["micro_batch"], seq_len=spec["seq"]).total
    if need > 0.9 * free_bytes:
        raise BadInput(f"the speed model ({size.total_params / 1e9:.2f}B parameters, micro-batch "
                       f"{spec['micro_batch']} x {spec['seq']}) needs about {need / 2**30:.1f} GiB, "
                       f"{free_bytes / 2**30:.1f} GiB is free: lower --layers or --hidden")
    return {"params": size.total_params, "estimated_bytes": int(need), "free_bytes": free_bytes}


# ------------------------------------------------------------------------------------------- the parts
def plan(args: argparse.Namespace, facts: dict[str, Any], tmp: str) -> dict[str, dict[str, Any]]:
    """Each part's spec: sizes and its configurations (each one process unless --quick)."""
    q = args.quick
    mlp = {"d": 64, "blocks": 2, "batch": 4, "seq": 16} if q else {"d": 512, "blocks": 4, "batch": 8, "seq": 128}
    big = {"d": 128, "blocks": 2, "batch": 4, "seq": 16} if q else {"d": 1536, "blocks": 8, "batch": 8, "seq": 512}
    ref = {dtype: str(Path(tmp) / f"reference-{dtype}.pt") for dtype in ("fp32", "bf16")}
    correctness = [{"name": f"plain {d}", "impl": "plain", "dtype": d, "reference_file": ref[d]} for d in ref]
    worlds = [1, 2] if facts["count"] >= 2 else [1]
    for world in worlds:
        for dtype in ref:
            for stage, feature in ((0, ""), (0, "checkpointing"), (3, ""), (3, "checkpointing"), (3, "offload")):
                name = f"xshard-{stage} {dtype}" + (f" {feature}" if feature else "") + (f" x{world}" if world > 1 else "")
                correctness.append({"name": name, "impl": "xshard", "stage": stage, "dtype": dtype, "world": world,
                                    "reference_file": ref[dtype], **({feature: True} if feature else {})})
    sized = {k: v for k, v in (("layers", args.layers), ("hidden", args.hidden)) if v}
    model = {**(QUICK_MODEL if q else FULL_MODEL), **sized}
    speed = [{"name": "plain PyTorch", "impl": "plain"}, {"name": "FSDP2", "impl": "fsdp2"},
             {"name": "xshard-0", "impl": "xshard", "stage": 0}, {"name": "xshard-3", "impl": "xshard", "stage": 3},
             {"name": "Accelerate", "impl": "accelerate"}]
    common = {"device": args.device, "tmp": tmp}
    return {
        "correctness": {**common, **mlp, "steps": 3 if q else 4, "configs": correctness},
        "syncs": {**common, **mlp, "warmup": 2, "steps": 3 if q else 5,
                  "configs": [{"name": f"xshard-{s}", "stage": s} for s in (0, 3)]},
        "speed": {**common, "model": model, "seq": 128 if q else 2048, "micro_batch": 2 if q else 4,
                  "warmup": 2 if q else 3, "steps": 2 if q else 8, "compile": args.compile and not q,
                  "peak_tflops": facts["peak"]["tflops"], "configs": speed},
        "async_save": {**common, **big, "warmup": 1 if q else 2, "steps": 2 if q else 3, "repeats": 1 if q else 2,
                       "configs": [{"name": "xshard-3 sharded"}]},
        "offload": {**common, **big, "warmup": 1 if q else 2, "steps": 2 if q else 5,
                    "configs": [{"name": "offload off", "offload": False}, {"name": "offload on", "offload": True}]},
    }


def run_part(name: str, spec: dict[str, Any], budget: float, one_process: bool) -> dict[str, Any]:
    """Run one part's configurations in fresh processes within ``budget`` seconds; never raises."""
    deadline = time.monotonic() + budget
    # one configuration runs at a time: on a device machine its host work (offload's optimizer step) gets the cores
    threads = "2" if spec["device"] == "cpu" else str(min(os.cpu_count() or 1, 16))
    env = {"XSHARD_BACKEND": spec["device"], "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": threads,
           "XSHARD_LOG_LEVEL": "warning"}
    groups = [spec["configs"]] if one_process else [[c] for c in spec["configs"]]
    results: dict[str, Any] = {}
    for group in groups:
        left = deadline - time.monotonic()
        if left < 5:
            results.update({c["name"]: {"error": f"not run: the part's {budget:.0f} s budget was spent"} for c in group})
            continue
        by_world: dict[int, list[dict[str, Any]]] = {}
        for c in group:
            by_world.setdefault(c.get("world", 1), []).append(c)
        for world, configs in by_world.items():
            worker_spec = {**spec, "part": name, "configs": configs}
            try:
                results.update(run_ranks([__file__, "--worker", json.dumps(worker_spec)], world, env=env,
                                         timeout=max(5.0, deadline - time.monotonic()))[0])
            except RankFailure as exc:
                reason = str(exc).strip().splitlines()
                results.update({c["name"]: {"error": (reason[-1] if reason else "failed")[:400]} for c in configs})
    return results


def summarise(part: str, results: dict[str, Any]) -> dict[str, Any]:
    """A part's verdict: passed (correctness), xshard's syncs (goal 0), the async ratio (goal <= 0.2)."""
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    summary: dict[str, Any] = {"errors": errors}
    if part == "correctness":
        compared = [v for v in results.values() if "passed" in v]
        summary["passed"] = bool(compared) and not errors and all(v["passed"] for v in compared)
    elif part == "syncs":
        summary["from_xshard"] = sum(v.get("from_xshard", 0) for v in results.values())
        summary["goal_met"] = not errors and summary["from_xshard"] == 0
    elif part == "async_save":
        ratios = [v["ratio"] for v in results.values() if v.get("ratio") is not None]
        summary["goal_met"] = bool(ratios) and max(ratios) <= 0.2
    elif part == "offload" and not errors:
        summary["slowdown"] = round(results["offload on"]["step_s"] / results["offload off"]["step_s"], 3)
    return summary


# ------------------------------------------------------------------------------------------- the report
def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables, one per part."""
    m = report["machine"]
    lines = [f"# Device check, {report['date']}", "",
             f"{m['device']} (x{m['count']}), torch {m['torch']}"
             + "".join(f", {k} {m[k]}" for k in ("cuda", "driver", "torch_npu", "cann") if k in m)
             + f", Python {m['python']}, {m['cpu_cores']} CPU cores; --quick: {report['quick']}; "
             f"peak {report['peak']['tflops']} TFLOPS ({report['peak']['source']})", "",
             *(f"- not run: {reason}" for reason in report["not_run"]), ""]
    for part, body in report["parts"].items():
        lines += [f"## {part} ({body['seconds']} s of {body['budget_s']} s)", "", f"summary: `{json.dumps(body['summary'])}`", ""]
        keys = sorted({k for v in body["results"].values() for k in v if not isinstance(v[k], (list, dict))})
        lines += ["| configuration | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for name, v in body["results"].items():
            lines.append(f"| {name} | " + " | ".join(_cell(v.get(k, "")) for k in keys) + " |")
        lines.append("")
        lines += [f"- {name}, {k.replace('_', ' ')}: " + (", ".join(f"{where} x{n}" for where, n in v[k].items()) or "none")
                  for name, v in body["results"].items() for k in sorted(v) if k.endswith("_sources")]
        lines.append("")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help=f"one of {', '.join(DEVICES)} (default cuda)")
    parser.add_argument("--quick", action="store_true", help="small sizes, a part's configurations in one process")
    parser.add_argument("--compile", action="store_true", help="torch.compile every speed configuration (not in --quick)")
    parser.add_argument("--out", default="out/device-check", help="folder for report.json and report.md")
    parser.add_argument("--parts", nargs="+", default=list(BUDGETS), help=f"a subset of {', '.join(BUDGETS)}")
    parser.add_argument("--layers", type=int, help="decoder layers of the speed model (default 16; 2 in --quick)")
    parser.add_argument("--hidden", type=int, help="hidden size of the speed model (default 2048; 64 in --quick)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from device_check_workers import run_worker

        write_result(run_worker(json.loads(args.worker)))
        return 0
    try:
        if args.device not in DEVICES:
            raise BadInput(f"--device {args.device!r} is not known: use one of {', '.join(DEVICES)}")
        unknown = [p for p in args.parts if p not in BUDGETS]
        if unknown:
            raise BadInput(f"--parts {' '.join(unknown)}: not a part; the parts are {', '.join(BUDGETS)}")
        for flag in ("layers", "hidden"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise BadInput(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
        facts = device_facts(args.device)
        facts["peak"] = peak_tflops(facts, args.device)
        with tempfile.TemporaryDirectory(prefix="xshard-device-check-") as tmp:
            specs = plan(args, facts, tmp)
            fits = check_fits(specs["speed"], facts["free_bytes"]) if "speed" in args.parts else None
            report = run_all(args, facts, specs, fits)
    except BadInput as exc:
        print(f"device_check: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    print(f"\nwritten: {out / 'report.json'}, {out / 'report.md'}")
    return 0


def run_all(args: argparse.Namespace, facts: dict[str, Any], specs: dict[str, dict[str, Any]],
            fits: dict[str, Any] | None) -> dict[str, Any]:
    """Every asked part in turn, each within its budget; the whole report."""
    peak = facts.pop("peak")
    report: dict[str, Any] = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "quick": args.quick,
                              "machine": facts, "peak": peak, "speed_model_fit": fits,
                              "tolerances": _tolerances(), "parts": {}}
    report["not_run"] = not_run(args, facts)
    for part in args.parts:
        budget = (QUICK_BUDGETS if args.quick else BUDGETS)[part]
        start = time.monotonic()
        print(f"device_check: {part} (budget {budget:.0f} s)", file=sys.stderr, flush=True)
        try:
            results = run_part(part, specs[part], budget, one_process=args.quick)
        except Exception as exc:  # recorded; the next part still runs
            results = {"part": {"error": f"{type(exc).__name__}: {exc}"[:400]}}
        report["parts"][part] = {"budget_s": budget, "seconds": round(time.monotonic() - start, 1),
                                 "summary": summarise(part, results), "results": results}
    return report


def not_run(args: argparse.Namespace, facts: dict[str, Any]) -> list[str]:
    """What this machine or these options leave out, and why (a failing configuration says so in its row)."""
    left = [f"{p}: not asked (--parts)" for p in BUDGETS if p not in args.parts]
    if facts["count"] < 2:
        left.append("correctness at 2 processes: one device is visible (NCCL and HCCL take one rank per device)")
    if not args.compile or args.quick:
        left.append("torch.compile in the speed part: " + ("off in --quick" if args.quick else "--compile not given"))
    if args.device == "cpu":
        left.append("the device's idle share and the host-to-device copy overlap: not applicable on the CPU")
        left.append("host syncs under set_sync_debug_mode: no device queue on the CPU; xshard's reading calls "
                    "are counted instead")
    return left


def _tolerances() -> dict[str, dict[str, float]]:
    from device_check_workers import TOLERANCES

    return TOLERANCES


if __name__ == "__main__":
    sys.exit(main())
