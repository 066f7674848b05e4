"""``generate()`` tokens/s at stage 3 on 2 ranks: the whole model gathered once for the call (the fast path),
every unit at every decoding step (``synced_gpus``), and the unsharded model on each rank (the goal: the fast
path at 0.9x or more of it).

Each rank generates its own batch (greedy, a fixed number of new tokens) with a small random Qwen2; the
unsharded model runs on both ranks at once too, so the ranks share the cores alike in every configuration.
A configuration's time is the slower rank's median over the repeats, after one warm-up call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_runner import RESULT_ENV, run_ranks  # noqa: E402

CONFIGS = ("unsharded", "once", "per_unit")


def _model(args: argparse.Namespace):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64 or 1,
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return Qwen2ForCausalLM(config).eval()


def _time_generate(model, ids, args: argparse.Namespace) -> list[float]:
    import torch

    times = []
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
    return times


def worker(args: argparse.Namespace) -> None:
    """One rank: every configuration in turn, each sharded one on its own Accelerator."""
    import torch

    import xshard

    rank = int(os.environ["RANK"])
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(rank))
    result: dict = {}
    for config in CONFIGS:
        acc = xshard.Accelerator(stage=3, seed=0, generate_gathers_once=config == "once")
        if config == "unsharded":
            model = _model(args)
        else:
            model = acc.unwrap_model(acc.prepare(_model(args)))
        acc.wait_for_everyone()
        result[config] = _time_generate(model, ids, args)
        acc.end()
    Path(os.environ[RESULT_ENV]).write_text(json.dumps(result))


def main() -> None:
    """Run the ranks and print tokens/s per configuration and the ratios to the unsharded model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = run_ranks([__file__, "--worker", *sys.argv[1:]], 2, env={"XSHARD_LOG_LEVEL": "warning"})
    tokens = args.batch * args.new_tokens
    seconds = {c: max(statistics.median(r[c]) for r in results) for c in CONFIGS}
    load = os.getloadavg()[0]
    print(f"Qwen2 d={args.hidden} x {args.layers} layers, vocab {args.vocab}; batch {args.batch} x prompt "
          f"{args.prompt}, {args.new_tokens} new tokens; 2 ranks; median of {args.repeats}; load (1 min) {load:.1f}")
    print("| config | s/call | tokens/s/rank | x unsharded |")
    print("|---|---|---|---|")
    for config in CONFIGS:
        print(f"| {config} | {seconds[config]:.3f} | {tokens / seconds[config]:.1f} | "
              f"{seconds['unsharded'] / seconds[config]:.2f} |")


if __name__ == "__main__":
    main()
