"""A causal-LM training script written the way transformers' ``*_no_trainer`` examples are (run_clm_no_trainer).

Only the imports differ (``ACCELERATOR=xshard`` or ``accelerate``); below them: a logger from
``get_logger(__name__)`` used with ``main_process_only=False``, ``DistributedType``, ``accumulate``, a
linear schedule, ``--checkpointing_steps`` with ``save_state("step_<n>")``, ``--resume_from_checkpoint``
(the example's arithmetic and ``skip_first_batches``), ``--with_tracking`` (tensorboard,
``init_trackers`` / ``log`` / ``end_training``) and evaluation with
``gather_for_metrics(loss.repeat(per_device_eval_batch_size))``. Prints one ``RESULT {json}`` line on
the main process (and writes it to ``<output_dir>/result.json``): each micro-step's
loss averaged over the processes, and each epoch's eval loss.

Data order fixed: both loaders are unshuffled, and both libraries give rank ``r`` the ``r``-th batch of
every global batch (the evening repeats of the last evaluation batch included).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

if os.environ.get("ACCELERATOR") == "xshard":
    from xshard import Accelerator, DistributedType
    from xshard.logging import get_logger
    from xshard.utils import set_seed
else:
    from accelerate import Accelerator, DistributedType
    from accelerate.logging import get_logger
    from accelerate.utils import set_seed

logger = get_logger(__name__)
VOCAB, BLOCK = 64, 16


def blocks(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` token blocks (input_ids = labels, as group_texts makes them)."""
    ids = torch.randint(0, VOCAB, (n, BLOCK), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--with_tracking", action="store_true")
    args = parser.parse_args()

    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = "tensorboard"
        accelerator_log_kwargs["project_dir"] = args.output_dir
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **accelerator_log_kwargs)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(0)

    train_set, eval_set = blocks(32, seed=1), blocks(15, seed=2)  # 15: an uneven last evaluation batch
    train_dataloader = DataLoader(train_set, batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size)

    config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)  # tied input and output embeddings, as GPT-2's
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=0,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    if accelerator.distributed_type == DistributedType.XLA:
        model.tie_weights()
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", {"lr": args.learning_rate, "epochs": args.num_train_epochs})

    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_set)}")
    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint))[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // args.gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)

    step_losses, eval_losses = [], []
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = 0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                step_losses.append(accelerator.reduce(loss.detach(), "mean").item())
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
            if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0 \
                    and accelerator.sync_gradients:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        eval_loss = torch.mean(losses)
        eval_losses.append(eval_loss.item())
        logger.info(f"epoch {epoch}: perplexity: {math.exp(eval_loss)} eval_loss: {eval_loss}")
        if args.with_tracking:
            accelerator.log({"eval_loss": eval_loss.item(), "train_loss": total_loss.item() / len(train_dataloader),
                             "epoch": epoch, "step": completed_steps}, step=completed_steps)
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        result = json.dumps({"step_losses": step_losses, "eval_losses": eval_losses, "eval_count": len(losses)})
        print("RESULT " + result, flush=True)
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            f.write(result)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
