"""Peak host memory per rank while loading a model folder: sharded loading vs whole model per rank.

    python benchmarks/loading_memory.py [--layers 24 --hidden 1024 --vocab 32000] [--nproc 2]

Writes a random Qwen2 (about 375M parameters by default) with ``save_pretrained`` (safetensors, bf16
like the published Qwen checkpoints) to a temporary folder, then starts ``--nproc`` CPU ranks twice:

- ``whole``: every rank runs ``AutoModelForCausalLM.from_pretrained(folder, dtype=float32)`` and then
  ``acc.prepare(model)`` (stage 3): what a script without sharded loading does;
- ``sharded``: every rank runs ``xshard.pretrained.from_pretrained_sharded(AutoModelForCausalLM,
  folder, acc, dtype=float32)``: parameters built on the meta device, each rank reads only its rows.

Both end with the same fp32 master shards on every rank. Each rank reports the lifetime peak of its
resident memory (VmHWM from /proc/self/status) after loading, and the resident memory after the
imports (torch + transformers), so the loading's own share is visible. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("whole", "sharded")


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmHWM, VmRSS) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def write_model(folder: Path, layers: int, hidden: int, vocab: int) -> int:
    """A random Qwen2 saved as bf16 safetensors; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         tie_word_embeddings=False, use_sliding_window=False)
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def rank_main(mode: str, folder: str, out_dir: str) -> None:
    """One rank: load ``folder`` the ``mode`` way, report its peaks."""
    import torch
    from transformers import AutoModelForCausalLM

    import xshard
    from xshard.pretrained import from_pretrained_sharded

    after_imports = status_kib("VmRSS")
    acc = xshard.Accelerator(config={"stage": 3}, seed=0, log_level="warning")
    start = time.perf_counter()
    if mode == "whole":
        model = acc.prepare(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    else:
        model = from_pretrained_sharded(AutoModelForCausalLM, folder, acc, dtype=torch.float32)
    seconds = time.perf_counter() - start
    local = sum(p.numel() for p in model.parameters())
    report = {"mode": mode, "rank": acc.rank, "peak_kib": status_kib("VmHWM"), "after_imports_kib": after_imports,
              "rss_after_load_kib": status_kib("VmRSS"), "local_params": local, "load_seconds": seconds}
    Path(out_dir, f"{mode}.rank{acc.rank}.json").write_text(json.dumps(report))
    acc.end()


def run_mode(mode: str, folder: Path, out_dir: Path, nproc: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           __file__, "--rank-main", mode, str(folder), str(out_dir)]
    env = {**os.environ, "XSHARD_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, check=True)
    return [json.loads((out_dir / f"{mode}.rank{r}.json").read_text()) for r in range(nproc)]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rank-main", nargs=3, metavar=("MODE", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(*args.rank_main)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder, out_dir = Path(tmp) / "model", Path(tmp) / "reports"
        out_dir.mkdir()
        params = write_model(folder, args.layers, args.hidden, args.vocab)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"random Qwen2: {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB of bf16 safetensors; "
              f"fp32 in memory: {params * 4 / 2**20:.0f} MiB; {args.nproc} ranks, stage 3")
        results = {mode: run_mode(mode, folder, out_dir, args.nproc) for mode in MODES}
    print("\n| mode | rank | peak RSS MiB | RSS after imports MiB | peak - imports MiB | params held | load s |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        for r in results[mode]:
            print(f"| {mode} | {r['rank']} | {r['peak_kib'] / 1024:.0f} | {r['after_imports_kib'] / 1024:.0f} | "
                  f"{(r['peak_kib'] - r['after_imports_kib']) / 1024:.0f} | {r['local_params'] / 1e6:.0f}M | "
                  f"{r['load_seconds']:.1f} |")
    worst = {mode: max(r["peak_kib"] for r in results[mode]) for mode in MODES}
    own = {mode: max(r["peak_kib"] - r["after_imports_kib"] for r in results[mode]) for mode in MODES}
    print(f"\npeak RSS per rank, whole / sharded: {worst['whole'] / worst['sharded']:.2f}x; "
          f"loading's own share (peak - imports): {own['whole'] / max(1, own['sharded']):.2f}x")
    print(json.dumps({"params": params, "nproc": args.nproc, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
