"""The loop patterns of Accelerate's own example programs, written for these tests; only the import differs
(``ACCELERATOR=xshard`` or ``accelerate``).

    python accelerate_patterns_script.py --pattern PATTERN[,PATTERN...] [--stateful] [--save_at STEP --output_dir DIR]
                                         [--resume DIR]

Every pattern seeds as Accelerate's examples do, ``set_seed(42)`` after building the Accelerator (``seed_first``:
before it), shuffles its training data with a plain ``shuffle=True`` and trains a small net with dropout for 3
epochs with AdamW and a linear schedule:

- ``default``: the loop of ``nlp_example.py`` (``for step, batch in enumerate(loader)``), Accelerate's default
  loader (``use_seedable_sampler=False``); ``seedable``: the same with ``use_seedable_sampler=True`` (the Trainer's
  choice); ``seed_first``: the default loader, ``set_seed`` before the Accelerator;
- ``next_calls``: ``gradient_accumulation_for_autoregressive_models.py``'s loop: each epoch a new ``iter()``, from
  which each update takes its micro-batches with ``next()`` (exactly ``len(loader)`` calls per epoch), the first
  ones under ``no_sync``;
- ``early_stop``: ``early_stopping.py``'s loop: a ``break`` (through ``set_trigger`` / ``check_trigger``) in the
  middle of the first epoch, then the next epoch's ``for`` over the same loader;
- ``accumulate``: ``gradient_accumulation.py``'s loop, ``with accelerator.accumulate(model)`` over 2 micro-steps.

Each epoch ends with an evaluation through ``gather_for_metrics``. ``--save_at`` saves the state after that many
optimizer steps and at the end of the first epoch, after its evaluation (``DIR/PATTERN/mid``, ``DIR/PATTERN/epoch``);
``--resume`` loads one and goes on (``skip_first_batches`` in the resumed epoch, as ``checkpointing.py`` does,
except with ``--stateful``: ``use_stateful_dataloader=True``, whose loader resumes by itself). Prints one
``RESULT {json}`` line on the main process, each pattern's results by pattern: every step's losses (each
process's, gathered), the sample ids each process read, the accumulation and loader flags (``sync_gradients``,
``end_of_dataloader``, ``remainder``), the evaluation's predictions, and the final weights.

Several patterns run one after the other in one job (one launch instead of one per pattern, as the suite runs
them): each builds its own Accelerator, seeds, and builds its model and loaders afresh, so it trains as it
would in a process of its own; the job ends (``end_training``) after the last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("ACCELERATOR") == "xshard":
    from xshard import Accelerator
    from xshard.utils import DataLoaderConfiguration, set_seed
else:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

EPOCHS = 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


class Net(nn.Module):
    """Two blocks (each a unit of its own at stages 1-3) and a head, with dropout."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.blocks = nn.Sequential(Block(12), Block(12))
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x.sum(-1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g), torch.arange(n))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", required=True, help="one pattern, or several separated by commas")
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--stateful", action="store_true")
    args = parser.parse_args()
    patterns = args.pattern.split(",")
    if args.resume and len(patterns) > 1:
        parser.error("--resume loads one pattern's state: give one --pattern")
    results = {}
    for pattern in patterns:
        results[pattern], accelerator = run_pattern(pattern, args)
    if accelerator.is_main_process:
        print("RESULT " + json.dumps(results), flush=True)
        if os.environ.get("RESULT_FILE"):  # complete or absent: what a test reads of a job whose exit it does not wait for
            Path(os.environ["RESULT_FILE"] + ".tmp").write_text(json.dumps(results))
            os.replace(os.environ["RESULT_FILE"] + ".tmp", os.environ["RESULT_FILE"])
    accelerator.end_training()


def run_pattern(pattern: str, args: argparse.Namespace) -> tuple[dict, Accelerator]:
    """Train ``pattern``; its results (complete on the main process) and its Accelerator."""
    if pattern == "seed_first":
        set_seed(42)
    accumulation = 2 if pattern in ("next_calls", "accumulate") else 1
    config = DataLoaderConfiguration(use_seedable_sampler=pattern == "seedable",
                                     use_stateful_dataloader=args.stateful)
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, dataloader_config=config)
    if pattern != "seed_first":
        set_seed(42)
    train = DataLoader(data(44, 1), batch_size=4, shuffle=True)
    evaluation = DataLoader(data(18, 2), batch_size=4)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=40)
    model, optimizer, train, evaluation, schedule = accelerator.prepare(model, optimizer, train, evaluation, schedule)

    out: dict = {"losses": [], "read": [], "predictions": [], "flags": []}
    steps, start_epoch, resume_step = 0, 0, 0
    if args.resume:
        accelerator.load_state(args.resume)
        with open(os.path.join(args.resume, "position.json")) as f:
            start_epoch, resume_step, steps = json.load(f)

    def save(name: str, epoch: int, step: int) -> None:
        folder = os.path.join(args.output_dir, pattern, name)
        accelerator.save_state(folder)
        if accelerator.is_main_process:
            with open(os.path.join(folder, "position.json"), "w") as f:
                json.dump([epoch, step, steps], f)
        accelerator.wait_for_everyone()

    def record(loss: torch.Tensor, ids: torch.Tensor) -> None:
        out["losses"].append(accelerator.gather(loss.detach().reshape(1)).tolist())
        out["read"].append(accelerator.gather(ids).tolist())
        state = accelerator.gradient_state
        out["flags"].append([accelerator.sync_gradients, state.end_of_dataloader, state.remainder])

    for epoch in range(start_epoch, EPOCHS):
        model.train()
        if pattern == "next_calls":
            iterator = iter(train)
            updates, left = divmod(len(train), accumulation)
            for update in range(updates + (1 if left else 0)):
                micro = [next(iterator) for _ in range(accumulation if update < updates else left)]
                for i, (x, y, ids) in enumerate(micro):
                    last = i == len(micro) - 1
                    with contextlib.nullcontext() if last else accelerator.no_sync(model):
                        loss = nn.functional.mse_loss(model(x), y)
                        accelerator.backward(loss * accumulation)
                    record(loss, ids)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        else:
            loader = train
            if args.resume and epoch == start_epoch and resume_step and not args.stateful:
                loader = accelerator.skip_first_batches(train, resume_step)
            for step, (x, y, ids) in enumerate(loader, start=resume_step if loader is not train else 0):
                with accelerator.accumulate(model) if pattern == "accumulate" else contextlib.nullcontext():
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    schedule.step()
                    optimizer.zero_grad()
                record(loss, ids)
                steps += 1
                if args.save_at and epoch == 0 and step + 1 == args.save_at:
                    save("mid", epoch, step + 1)
                if pattern == "early_stop" and epoch == 0 and step == 4:
                    accelerator.set_trigger()
                if accelerator.check_trigger():
                    break
            resume_step = 0
        model.eval()
        for x, _, ids in evaluation:
            with torch.no_grad():
                predictions = model(x)
            predictions, ids = accelerator.gather_for_metrics((predictions, ids))
            out["predictions"].append([predictions.flatten().tolist(), ids.tolist()])
        if args.save_at and epoch == 0:
            save("epoch", epoch + 1, 0)

    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        out["weights"] = {name: value.flatten().tolist() for name, value in sorted(weights.items())}
    return out, accelerator


if __name__ == "__main__":
    main()
