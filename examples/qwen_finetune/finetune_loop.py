"""The same Alpaca fine-tune as finetune.py, written as its own loop on ``xshard.Accelerator`` (no Trainer).

finetune.py is the guide's Trainer script; this version shows what the Trainer does for you, step by
step, and what xshard adds to a hand-written loop:

    torchrun --nproc_per_node=8 finetune_loop.py --model_name_or_path /path/to/qwen1.5_7b_chat \\
        --data_path alpaca_data.json --deepspeed ds_config_zero3.json --bf16 True --output_dir ./test/output ...
    XSHARD_BACKEND=cpu xshard launch --nproc 2 finetune_loop.py --deepspeed ds_config_zero3.json --output_dir out

A real model is loaded with ``xshard.pretrained.from_pretrained_sharded``: built without weights,
sharded, and each rank reads only its own rows of the checkpoint, so 8 ranks on one host never hold
8 copies of the model. bf16 is used when ``--bf16`` asks and the device can (NPUs before 910B
cannot: then fp32, with a log line). The run ends with a ``save_pretrained`` folder in
``--output_dir``, written by rank 0 from the gathered full weights.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the example's own modules, wherever it is run from

from args import FinetuneArguments, parse_args, str_to_bool  # noqa: E402
from data import SupervisedCollator, SupervisedDataset, check_vocab_fits, load_records, prepare_tokenizer  # noqa: E402
from tiny import DEFAULT_DATA, build_tiny_qwen  # noqa: E402
from train_loop import (  # noqa: E402
    StepLog,
    decay_groups,
    make_scheduler,
)

import xshard  # noqa: E402
from xshard.config import XShardConfig  # noqa: E402
from xshard.logging import get_logger  # noqa: E402

log = get_logger("xshard.examples.finetune")


# ---------------------------------------------------------------------------------------------- setup
def load_config(args: FinetuneArguments) -> XShardConfig:
    """The sharding config from --config/--deepspeed (``"auto"`` filled from the arguments) or --fsdp."""
    from_args = {"gradient_accumulation_steps": args.gradient_accumulation_steps,
                 "gradient_clipping": args.max_grad_norm}
    if args.fsdp:
        return XShardConfig.from_hf_fsdp(args.fsdp, args.fsdp_config, overrides=from_args)
    path = args.config or args.deepspeed
    if path is None:
        return XShardConfig.load(None, overrides={**from_args, "mixed_precision": args.mixed_precision})
    return XShardConfig.load(path, script_args=args)


def choose_precision(acc: xshard.Accelerator, config: XShardConfig, args: FinetuneArguments) -> None:
    """--bf16/--fp16 win over the file; bf16 only where the device has it (else fp32, with a warning)."""
    wanted = args.mixed_precision if args.mixed_precision != "no" else config.mixed_precision
    if wanted != "no" and not acc.supports(wanted):
        log.warning("%s was asked for, but the %s backend cannot compute in it here: training in fp32 instead",
                    wanted, acc.backend.name)
        wanted = "no"
    acc.mixed_precision = wanted


def build_model(args: FinetuneArguments, acc: xshard.Accelerator, data_path: Path) -> tuple[Any, Any]:
    """(prepared model, tokenizer): the local folder loaded shard by shard, or the tiny offline Qwen2."""
    if args.model_name_or_path is None:
        log.info("no --model_name_or_path: a tiny random Qwen2 and a tokenizer trained on %s", data_path.name)
        model, tokenizer = build_tiny_qwen(data_path)
        model.config.use_cache = False
        return acc.prepare(model), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xshard.pretrained import from_pretrained_sharded

    folder = Path(args.model_name_or_path)
    if not folder.is_dir():
        raise SystemExit(f"--model_name_or_path {folder}: no such folder. This example runs offline: download the "
                         "model first (e.g. `huggingface-cli download Qwen/Qwen1.5-7B-Chat --local-dir <folder>` "
                         "or openMind's `om download`) and pass the folder")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    # fp32 master weights (the checkpoint's bf16 values are cast on load); compute runs in the config's dtype
    model = from_pretrained_sharded(AutoModelForCausalLM, folder, acc, dtype=torch.float32)
    model.config.use_cache = False
    return model, tokenizer


def resume(acc: xshard.Accelerator, args: FinetuneArguments) -> int:
    """Load the checkpoint --resume_from_checkpoint names (a folder, or True for the newest complete one
    in --output_dir); returns the optimizer step to continue from (0 when not resuming)."""
    value = args.resume_from_checkpoint
    if value is None:
        return 0
    try:
        latest = str_to_bool(value)
    except ValueError:  # not a boolean word (argparse.ArgumentTypeError): a checkpoint folder
        loaded = acc.load_state(value)
    else:
        if not latest:
            return 0
        loaded = acc.load_state(args.output_dir, resume_from_checkpoint=True)  # none there: an error naming it
    log.info("resumed from %s at step %d", loaded, acc.step)
    return acc.step


def total_steps(args: FinetuneArguments, batches_per_epoch: int) -> int:
    """--max_steps, or --num_train_epochs worth of optimizer steps."""
    if args.max_steps > 0:
        return args.max_steps
    return max(1, math.ceil(args.num_train_epochs * math.ceil(batches_per_epoch / args.gradient_accumulation_steps)))


# ---------------------------------------------------------------------------------------------- training
def train(args: FinetuneArguments) -> int:
    """Run the fine-tune; returns the number of optimizer steps done."""
    config = load_config(args)
    overrides: dict[str, Any] = {"mixed_precision": "no"}  # chosen below, once the device is bound
    if args.gradient_checkpointing:
        overrides["activation_checkpointing"] = True
    # The HF Trainer's schedule: one step per optimizer step, whatever the process count (its loop
    # steps the scheduler itself, after each real optimizer step).
    acc = xshard.Accelerator(config=config, seed=args.seed, step_scheduler_with_optimizer=False, **overrides)
    choose_precision(acc, config, args)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    data_path = Path(args.data_path) if args.data_path else DEFAULT_DATA

    model, tokenizer = build_model(args, acc, data_path)
    prepare_tokenizer(tokenizer, args.model_max_length)
    check_vocab_fits(tokenizer, model)
    dataset = SupervisedDataset(load_records(data_path), tokenizer, args.model_max_length)
    if dataset.dropped:
        log.warning("%d records dropped: their prompt alone fills --model_max_length %d",
                    dataset.dropped, args.model_max_length)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.per_device_train_batch_size, shuffle=True,
                                         collate_fn=SupervisedCollator(tokenizer.pad_token_id))

    optim = dict((config.optimizer or {}).get("params") or {})  # a ds_config's optimizer, "auto"s resolved
    optimizer = torch.optim.AdamW(
        decay_groups(model.named_parameters(), float(optim.get("weight_decay", args.weight_decay))),
        lr=float(optim.get("lr", args.learning_rate)),
        betas=tuple(optim.get("betas", (args.adam_beta1, args.adam_beta2))),
        eps=float(optim.get("eps", args.adam_epsilon)))
    loader = acc.prepare(loader)
    steps = total_steps(args, len(loader))
    scheduler = make_scheduler(optimizer, args.lr_scheduler_type, steps, args.warmup_ratio)
    optimizer, scheduler = acc.prepare(optimizer, scheduler)

    step = resume(acc, args)
    acc.print(f"training {steps} steps on {acc.world_size} process(es), backend {acc.backend.name}, "
              f"precision {acc.mixed_precision}, stage {acc.sharding_options().stage}, "
              f"{len(dataset)} examples, micro-batch {args.per_device_train_batch_size}, "
              f"accumulation {acc.gradient_accumulation_steps}")

    model.train()
    step_log = StepLog(args.output_dir, acc.is_main_process, write=acc.print)
    bar = acc.progress(total=steps, initial=step, desc="steps")
    while step < steps:
        for batch in loader:
            with acc.accumulate(model), acc.autocast():
                loss = model(**batch).loss
                acc.backward(loss)
                grad_norm = None
                if acc.sync_gradients and acc.gradient_clipping > 0:
                    grad_norm = acc.clip_grad_norm_(model.parameters(), acc.gradient_clipping)
                optimizer.step()
                if acc.sync_gradients and not acc.optimizer_step_was_skipped:
                    scheduler.step()
                optimizer.zero_grad()
            stats = acc.reduce({"loss": loss.detach().float(),
                                "tokens": batch["attention_mask"].sum().float()}, reduction="sum")
            step_log.add_micro_batch(stats["loss"].item() / acc.world_size, int(stats["tokens"].item()))
            if not acc.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if step % args.logging_steps == 0 or step == steps:
                extra = {"device_peak_mb": acc.backend.memory_stats().get("peak", 0) / 2**20}
                if grad_norm is not None:
                    extra["grad_norm"] = float(grad_norm)
                step_log.emit(step, steps, scheduler.get_last_lr()[0], extra)
            if args.save_strategy == "steps" and step % args.save_steps == 0:
                save_checkpoint(acc, args, step)
            if step >= steps:
                break
        else:
            if args.save_strategy == "epoch":
                save_checkpoint(acc, args, step)
    bar.close()
    save_final(acc, model, tokenizer, args.output_dir)
    acc.end()
    return step


def save_checkpoint(acc: xshard.Accelerator, args: FinetuneArguments, step: int) -> None:
    """``checkpoint-<step>`` in --output_dir; the oldest beyond --save_total_limit are removed."""
    acc.save_state(Path(args.output_dir) / f"checkpoint-{step}", save_total_limit=args.save_total_limit)


def save_final(acc: xshard.Accelerator, model: Any, tokenizer: Any, output_dir: str) -> None:
    """A Hugging Face folder (``from_pretrained`` loads it): full weights gathered to rank 0, which writes."""
    state = acc.full_state_dict(model)  # every rank takes part; complete on rank 0
    if acc.is_main_process:
        module = acc.unwrap_model(model)
        module.config.use_cache = True
        module.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
        log.info("saved the fine-tuned model and tokenizer to %s", output_dir)
    acc.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
