"""A TRL GRPO step through ``xshard.trainer.TrainerMixin``: stage 3 against stage 0 (goal: at most 1.1x).

```
python benchmarks/grpo_step.py                       # 2 ranks, Qwen2 d=256 x 4 layers, 3 configurations
python benchmarks/grpo_step.py --repeats 3           # medians of 3 round-robin runs
```

A GRPO step generates every prompt's group of completions with the model being trained, scores them with a
reward function and takes one optimizer step on them. At stage 3 the generation is the cost that matters: with
TRL's default ``ds3_gather_for_generation=True`` xshard's ``generate`` gathers the whole model once for the
call (the fast path, ``docs/sharded-core.md``), with ``False`` every unit at every decoding step. Three
configurations, each in its own fresh set of rank processes, same model, prompts, seed and settings:

| name | what runs |
|---|---|
| `stage-0` | ``class X(TrainerMixin, trl.GRPOTrainer)`` with TRL's ``GRPOConfig`` at ZeRO stage 0 (replicated) |
| `stage-3` | the same at stage 3, TRL's default ``ds3_gather_for_generation=True`` (one gather per call) |
| `stage-3-per-unit` | stage 3 with ``ds3_gather_for_generation=False`` (every unit at every decoding step) |

Measured: **s/step**, the median interval between consecutive optimizer-step ends after the warm-up steps
(generation, the reward, the loss's forward and backward, the optimizer step, TRL's bookkeeping), the slower
rank's; ratios to ``stage-0`` of the same run. The model is a random Qwen2 with the tokenizer of
``examples/qwen_finetune/tiny.py``; completions are sampled (TRL's default temperature 1.0, fixed seed) to
``--completion`` tokens at most. Only ratios within one run mean anything on a shared machine.
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
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

CONFIGS = ("stage-0", "stage-3", "stage-3-per-unit")
PROMPTS = ("Give three tips for staying healthy.", "What is the capital of France?", "Name a prime number.",
           "Describe the ocean in one sentence.", "Translate 'good morning' to Spanish.", "What is 12 times 7?",
           "Write a haiku about autumn.", "List two primary colours.")


def reward_length(completions: list[str], **kwargs: object) -> list[float]:
    """Completions of about 20 characters are best (a reward that costs nothing beside the step)."""
    return [-abs(20 - len(c)) / 20.0 for c in completions]


# ------------------------------------------------------------------------------------------ one rank

def _model(opts: argparse.Namespace, vocab: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=opts.hidden, intermediate_size=opts.hidden * 11 // 4,
                         num_hidden_layers=opts.layers, num_attention_heads=max(1, opts.hidden // 64),
                         num_key_value_heads=max(1, opts.hidden // 128), max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def worker(opts: argparse.Namespace) -> None:
    """One rank of one configuration: train ``warmup + steps`` GRPO steps, write the step times."""
    import datasets
    import transformers
    import trl
    from rank_runner import RESULT_ENV

    from xshard.trainer import TrainerMixin

    os.environ["XSHARD_STAGE"] = "0" if opts.config == "stage-0" else "3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.tokenizer)
    ends: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    cls = type("XShardGRPOTrainer", (TrainerMixin, trl.GRPOTrainer), {})
    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(output_dir=out, max_steps=opts.warmup + opts.steps, learning_rate=1e-5,
                              per_device_train_batch_size=opts.generations, num_generations=opts.generations,
                              max_completion_length=opts.completion, logging_steps=10_000, save_strategy="no",
                              report_to="none", disable_tqdm=True, seed=0, bf16=False,
                              ds3_gather_for_generation=opts.config != "stage-3-per-unit")
        rows = [{"prompt": p + "\n"} for p in PROMPTS] * 64
        trainer = cls(model=_model(opts, len(tokenizer)), args=args, train_dataset=datasets.Dataset.from_list(rows),
                      processing_class=tokenizer, reward_funcs=reward_length, callbacks=[Clock()])
        trainer.train()
    steps = [b - a for a, b in zip(ends[opts.warmup - 1:], ends[opts.warmup:], strict=False)]
    Path(os.environ[RESULT_ENV]).write_text(json.dumps({"step_s": statistics.median(steps), "steps": steps}))


# ------------------------------------------------------------------------------------------ the driver

def main() -> None:
    """Run each configuration ``--repeats`` times round robin; print s/step and the ratios to stage 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt, also each rank's batch (so 2 prompts a step on 2 ranks)")
    parser.add_argument("--completion", type=int, default=32, help="new tokens per completion at most")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (medians are shown)")
    parser.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", dest="config", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.config is not None:
        worker(opts)
        return

    from rank_runner import run_ranks

    with tempfile.TemporaryDirectory(prefix="xshard-grpo-") as tmp:
        example = ROOT / "examples" / "qwen_finetune"
        subprocess.run([sys.executable, str(example / "tiny.py"), "--output_dir", tmp,
                        "--data_path", str(example / "data" / "alpaca_synthetic.json")], check=True,
                       capture_output=True)
        print(f"TRL GRPO, Qwen2 d={opts.hidden} x {opts.layers} layers; {opts.world_size} ranks x "
              f"{opts.generations} completions of at most {opts.completion} tokens per step; "
              f"{opts.warmup} warm-up + {opts.steps} timed steps; fp32", flush=True)
        runs: dict[str, list[float]] = {name: [] for name in opts.configs}
        for _ in range(opts.repeats):  # round robin: a change in the machine's load reaches every configuration
            for name in opts.configs:
                ranks = run_ranks([str(Path(__file__).resolve()), *sys.argv[1:], "--tokenizer", tmp, "--worker", name],
                                  opts.world_size, env={"PYTHONPATH": str(ROOT)})
                runs[name].append(max(r["step_s"] for r in ranks))
                print(f"{name}: {runs[name][-1]:.3f} s/step", flush=True)
    results = {name: statistics.median(found) for name, found in runs.items()}
    base = results.get("stage-0")
    print(f"\n{'config':<18} {'s/step':>8} {'x stage 0':>10}")
    for name, step in results.items():
        ratio = f"{step / base:.3f}" if base else "-"
        print(f"{name:<18} {step:>8.3f} {ratio:>10}")


if __name__ == "__main__":
    main()
