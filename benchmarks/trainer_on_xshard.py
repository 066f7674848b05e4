"""The transformers Trainer on xshard against xshard's own loop and against the stock Trainer (Accelerate DDP).

```
python benchmarks/trainer_on_xshard.py                    # 2 ranks, Qwen2 d=1024 x 12 layers (207M params), stage 3
python benchmarks/trainer_on_xshard.py --repeats 3        # medians of 3 round-robin runs
python benchmarks/trainer_on_xshard.py --hidden 512 --layers 8 --vocab 8192   # a quick look (32M params)
```

The default model is one whose state, not the process, fills a rank: at 32M parameters the ~850 MiB that
every rank holds whatever shards it (Python, torch, transformers, activations, freed blocks the allocator
keeps) is most of the peak, so the RSS ratio stays near 0.82 however the state is split
(benchmarks/RESULTS.md, "By model size").

Three configurations, each in its own fresh set of rank processes, on the same model, data and optimizer:

| name | what runs |
|---|---|
| `xshard-trainer` | ``xshard.trainer.Trainer`` + ``xshard.trainer.TrainingArguments`` (the config's stage: ``--stage``) |
| `xshard-loop` | xshard's Accelerator in a plain loop: prepare, forward, backward, clip, AdamW step, schedule |
| `stock-trainer` | ``transformers.Trainer`` + ``TrainingArguments(use_cpu=True)``: Accelerate's DDP over gloo |

The model is a random ``Qwen2ForCausalLM`` trained on random token sequences (labels = inputs), AdamW as
the Trainer builds it (decay on matrices), a linear schedule, clipping at 1.0, fp32. What is measured:

- **s/step**: the median interval between consecutive optimizer-step ends after the warm-up steps (data
  loading, forward, backward, clipping, optimizer and scheduler steps, the Trainer's bookkeeping), the
  slowest rank's;
- **peak RSS MiB/rank**: the process's peak resident memory from the end of the warm-up to the end
  (``memory_probe``), the largest over ranks;
- with ``--repeats R`` the configurations run round robin R times and the table shows medians;
- ratios: the Trainer on xshard against xshard's own loop (goal <= 1.05) and against the stock Trainer on
  DDP (goal <= 1.0 for time and, at stage 3, <= 0.8 for peak RSS). Only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONFIGS = ("xshard-trainer", "xshard-loop", "stock-trainer")


# ------------------------------------------------------------------------------------------ one rank

def _model(hidden: int, layers: int, vocab: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


class _Tokens:
    """Random token sequences; each item is one training example (labels = input_ids)."""

    def __init__(self, count: int, seq: int, vocab: int) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (count, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StepClock:
    """Step-end times; the peak RSS measurement restarts when the warm-up ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ends: list[float] = []

    def step_ended(self) -> None:
        import memory_probe

        self.ends.append(time.perf_counter())
        if len(self.ends) == self.warmup:
            memory_probe.reset_peak_rss()

    def result(self) -> dict[str, Any]:
        import memory_probe

        steps = [b - a for a, b in zip(self.ends[self.warmup - 1:], self.ends[self.warmup:], strict=False)]
        return {"step_s": statistics.median(steps), "steps": steps,
                "peak_rss_mib": (memory_probe.peak_rss_bytes() or 0) / 2**20}


def _arguments(cls: type, opts: argparse.Namespace, out: str, **extra: Any) -> Any:
    return cls(output_dir=out, max_steps=opts.warmup + opts.steps, per_device_train_batch_size=opts.batch,
               learning_rate=1e-4, max_grad_norm=1.0, logging_steps=10_000, save_strategy="no", report_to="none",
               disable_tqdm=True, seed=0, dataloader_pin_memory=False, **extra)


def _run_trainer(opts: argparse.Namespace, stock: bool) -> dict[str, Any]:
    import transformers

    if stock:
        from transformers import Trainer, TrainingArguments
    else:
        from xshard.trainer import Trainer, TrainingArguments
    clock = _StepClock(opts.warmup)

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_ended()

    with tempfile.TemporaryDirectory() as out:
        args = _arguments(TrainingArguments, opts, out, **({"use_cpu": True} if stock else {}))
        trainer = Trainer(model=_model(opts.hidden, opts.layers, opts.vocab), args=args,
                          train_dataset=_Tokens(opts.samples, opts.seq, opts.vocab), callbacks=[Clock()])
        trainer.train()
    return clock.result()


def _run_loop(opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    import xshard
    from xshard.trainer import TrainingArguments

    accelerator = xshard.Accelerator(config={"stage": opts.stage}, seed=0)
    model = _model(opts.hidden, opts.layers, opts.vocab)
    with tempfile.TemporaryDirectory() as out:
        args = _arguments(TrainingArguments, opts, out)
    # the optimizer the Trainer builds from the same arguments: its class and settings, decay on matrices
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = cls([{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
                     {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], **kwargs)
    loader = torch.utils.data.DataLoader(_Tokens(opts.samples, opts.seq, opts.vocab), batch_size=opts.batch,
                                         shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    total = opts.warmup + opts.steps
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, total)
    clock = _StepClock(opts.warmup)
    model.train()
    for batch in loader:
        with accelerator.autocast():
            loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        clock.step_ended()
        if len(clock.ends) == total:
            break
    accelerator.end()
    return clock.result()


def worker(opts: argparse.Namespace) -> None:
    from rank_runner import RESULT_ENV

    os.environ["XSHARD_STAGE"] = str(opts.stage)
    if opts.config == "xshard-loop":
        result = _run_loop(opts)
    else:
        result = _run_trainer(opts, stock=opts.config == "stock-trainer")
    Path(os.environ[RESULT_ENV]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------ the driver

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3, help="xshard's ZeRO stage (both xshard configurations)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (medians are shown)")
    parser.add_argument("--worker", dest="config", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.config is not None:
        worker(opts)
        return

    from rank_runner import run_ranks

    params = sum(p.numel() for p in _model(opts.hidden, opts.layers, opts.vocab).parameters())
    print(f"Qwen2 d={opts.hidden} x {opts.layers} layers, vocab {opts.vocab}: {params / 1e6:.1f}M parameters; "
          f"{opts.world_size} ranks x {opts.batch} sequences x {opts.seq} tokens; xshard stage {opts.stage}; "
          f"{opts.warmup} warm-up + {opts.steps} timed steps; fp32 AdamW", flush=True)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in opts.configs}
    for _ in range(opts.repeats):  # round robin, so a change in the machine's load reaches every configuration
        for name in opts.configs:
            ranks = run_ranks([str(Path(__file__).resolve()), *sys.argv[1:], "--worker", name], opts.world_size)
            runs[name].append({"step_s": max(r["step_s"] for r in ranks),
                               "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)})
            print(f"{name}: {json.dumps(runs[name][-1])}", flush=True)
    results = {name: {key: statistics.median(run[key] for run in found) for key in ("step_s", "peak_rss_mib")}
               for name, found in runs.items()}

    print(f"\n{'config':<16} {'s/step':>8} {'x loop':>7} {'x stock':>8} {'peak RSS MiB/rank':>18} {'x stock':>8}")
    loop, stock = results.get("xshard-loop"), results.get("stock-trainer")
    for name, r in results.items():
        to_loop = f"{r['step_s'] / loop['step_s']:.3f}" if loop else "-"
        to_stock = f"{r['step_s'] / stock['step_s']:.3f}" if stock else "-"
        rss_stock = f"{r['peak_rss_mib'] / stock['peak_rss_mib']:.3f}" if stock else "-"
        print(f"{name:<16} {r['step_s']:>8.3f} {to_loop:>7} {to_stock:>8} {r['peak_rss_mib']:>18.0f} {rss_stock:>8}")


if __name__ == "__main__":
    main()
