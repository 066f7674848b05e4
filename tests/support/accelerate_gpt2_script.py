"""An ordinary Accelerate training script (GPT-2 from a config): the tests run it with Accelerate and with xshard.

Only the imports differ, chosen by ``ACCELERATOR=xshard``; everything below them is what an Accelerate
user writes: trackers, accumulation, clipping, a linear schedule, evaluation with
``gather_for_metrics``, automatic checkpoint naming with a total limit, ``get_state_dict`` +
``save_pretrained``, ``save_model`` and ``end_training``. Prints one ``RESULT {json}`` line on the main
process. Data: token sequences of a fixed recurrence (learnable), 48 for training, 37 for evaluation
(37 does not divide over 2 processes x batch 4, so the last evaluation batch is uneven).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

if os.environ.get("ACCELERATOR") == "xshard":
    from xshard import Accelerator
    from xshard.utils import ProjectConfiguration, set_seed
else:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

VOCAB, LENGTH = 64, 16


class Sequences(Dataset):
    """Sequences x[t+1] = (5 x[t] + 3) mod VOCAB from a random start (deterministic per index)."""

    def __init__(self, n: int, offset: int) -> None:
        self.starts = [(7 * (i + offset) + 1) % VOCAB for i in range(n)]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = [self.starts[i]]
        for _ in range(LENGTH - 1):
            ids.append((5 * ids[-1] + 3) % VOCAB)
        ids = torch.tensor(ids)
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    set_seed(0)
    accelerator = Accelerator(
        gradient_accumulation_steps=2, log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=args.out, automatic_checkpoint_naming=True, total_limit=1),
    )
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    train_dl = DataLoader(Sequences(48, 0), batch_size=4, shuffle=False)
    eval_dl = DataLoader(Sequences(37, 100), batch_size=4)
    no_decay = ["bias", "ln_"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    steps = args.epochs * len(train_dl) // 2
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                         scheduler)
    accelerator.init_trackers("gpt2", config={"lr": 3e-3, "epochs": args.epochs})

    losses, norms, lrs, eval_losses, eval_counts = [], [], [], [], []
    step = 0
    for _ in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                step += 1
                lrs.append(scheduler.get_last_lr()[0])
                accelerator.log({"train_loss": loss.item(), "lr": lrs[-1]}, step=step)
        model.eval()
        gathered = []
        for batch in eval_dl:
            with torch.no_grad():
                outputs = model(**batch)
            gathered.append(accelerator.gather_for_metrics(outputs.loss.repeat(len(batch["input_ids"]))))
        eval_loss = torch.cat(gathered)
        eval_losses.append(eval_loss.mean().item())
        eval_counts.append(len(eval_loss))
        accelerator.log({"eval_loss": eval_losses[-1]}, step=step)
        accelerator.save_state()

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(args.out, "model"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    accelerator.save_model(model, os.path.join(args.out, "model_sharded"), max_shard_size="100KB")
    accelerator.end_training()
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({"losses": losses, "norms": norms, "lrs": lrs, "eval_losses": eval_losses,
                                      "eval_counts": eval_counts}))


if __name__ == "__main__":
    main()
