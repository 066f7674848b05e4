"""Host memory over a long run: the Qwen demo's resident memory after warm-up, at every stage, bf16 and fp32.

    python benchmarks/host_memory_growth.py                       # 2 processes, 200 steps, stages 0-3
    python benchmarks/host_memory_growth.py --steps 400 --stages 3 --precisions bf16

Runs examples/qwen_finetune/finetune.py (tiny random Qwen2, the shipped synthetic data) through
``xshard launch``, records each rank's resident set size (RSS, /proc/self/statm) after every optimizer
step, and prints per configuration: RSS at the end of warm-up, at the end, and the growth in between
(the worst rank). A leak shows as growth proportional to the steps; allocator warm-up does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "qwen_finetune"


def _worker() -> None:
    """One rank: the example in this process, with an RSS reading after each optimizer step."""
    sys.path.insert(0, str(EXAMPLE))
    import finetune

    from xshard.runtime.prepared import PreparedOptimizer

    readings: list[float] = []
    step = PreparedOptimizer.step

    def measured(self: PreparedOptimizer, closure: object = None) -> None:
        step(self, closure)
        if self.job.sync_gradients:
            with open("/proc/self/statm") as f:
                readings.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20)

    PreparedOptimizer.step = measured
    finetune.main(sys.argv[2:])
    print("RSS_MB " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "rss": readings}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30, help="steps before the first reading that counts")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--output-dir", default="out/host-memory")
    args = parser.parse_args()
    print(f"{'stage':>5} {'precision':>9} {'rss@warmup MiB':>15} {'rss@end MiB':>12} {'growth MiB':>11}")
    for stage in args.stages:
        for precision in args.precisions:
            cmd = [sys.executable, "-m", "xshard", "launch", "--nproc", str(args.nproc), __file__, "--worker",
                   "--deepspeed", str(EXAMPLE / "ds_config_zero3.json"), "--output_dir", args.output_dir,
                   "--max_steps", str(args.steps), "--per_device_train_batch_size", "2", "--model_max_length",
                   "128", "--learning_rate", "1e-3", "--logging_steps", str(10 * args.steps), "--save_strategy",
                   "no", "--bf16", str(precision == "bf16")]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "XSHARD_STAGE": str(stage)})
            runs = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RSS_MB")]
            if proc.returncode != 0 or len(runs) != args.nproc:
                raise SystemExit(f"stage {stage} {precision} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            worst = max(runs, key=lambda r: r["rss"][-1] - r["rss"][args.warmup])
            start, end = worst["rss"][args.warmup], worst["rss"][-1]
            print(f"{stage:>5} {precision:>9} {start:>15.1f} {end:>12.1f} {end - start:>11.1f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker()
    else:
        main()
