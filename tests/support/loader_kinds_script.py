"""A training script fed by the loaders real programs build; only the imports differ (``ACCELERATOR=xshard`` or
``accelerate``).

    python loader_kinds_script.py --kind KIND[,KIND...] [--workers N] [--save_at STEP --output_dir DIR] [--resume DIR]

KIND: ``length_grouped`` (transformers' ``LengthGroupedSampler``), ``weighted`` (``WeightedRandomSampler``),
``batch_sampler`` (a bucketing batch sampler of the user's), ``generator`` (``shuffle=True`` with a seeded
generator), ``shuffle`` (a plain ``shuffle=True``, with ``use_seedable_sampler=True`` unless ``--seedable 0``),
``stream`` (an ``IterableDataset``), ``datasets`` (a streaming ``datasets.IterableDataset`` of 4
shards); every other random order comes from a seeded ``torch.Generator``. Each process reads its own share
(``dispatch_batches=False``).
A small net with dropout trains 2 epochs; each step's loss of each process and the sample ids each process
read are gathered (``accelerator.gather``: the gather order), then each epoch ends with an evaluation whose
per-sample predictions and ids go through ``gather_for_metrics``. ``--save_at`` saves the state after that
many steps (in the first epoch) in ``DIR/KIND/state``; ``--resume DIR`` loads ``DIR/KIND/state`` and goes on
from where it was. Prints one ``RESULT KIND {json}`` line per kind on the main process.

Several kinds run one after the other in one job (one launch instead of one per kind, as the suite runs them):
each kind builds its own Accelerator, seeds with ``set_seed(0)`` and builds its model and loaders afresh, so
it trains as it would in a process of its own; the job ends (``end_training``) after the last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset, WeightedRandomSampler

if os.environ.get("ACCELERATOR") == "xshard":
    from xshard import Accelerator
    from xshard.utils import DataLoaderConfiguration, set_seed
else:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

BATCH = 4


def tensors(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, x.sum(-1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g), torch.arange(n)


class Stream(IterableDataset):
    """Samples read one after the other, as from files."""

    def __init__(self, n: int, seed: int) -> None:
        self.x, self.y, self.ids = tensors(n, seed)

    def __iter__(self):
        for i in range(len(self.ids)):
            yield self.x[i], self.y[i], self.ids[i]


def as_tuples(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.stack([torch.as_tensor(row[k]) for row in rows]) for k in ("x", "y", "id"))


class Buckets(Sampler[list[int]]):
    """Batches of one length bucket each (bucket = id % 3), in an order its generator shuffles."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.batch_size, self.drop_last, self.generator = n, BATCH, False, generator
        by_bucket = [[i for i in range(n) if i % 3 == b] for b in range(3)]
        self.batches = [bucket[i:i + BATCH] for bucket in by_bucket
                        for i in range(0, len(bucket) - BATCH + 1, BATCH)]

    def __iter__(self):
        return iter([self.batches[i] for i in torch.randperm(len(self.batches), generator=self.generator).tolist()])

    def __len__(self) -> int:
        return len(self.batches)


def loader(kind: str, n: int, seed: int, workers: int) -> DataLoader:
    common = {"num_workers": workers}
    if kind == "stream":
        return DataLoader(Stream(n, seed), batch_size=BATCH, **common)
    if kind == "datasets":  # a streaming datasets.IterableDataset of 4 shards
        from datasets import Dataset

        x, y, ids = tensors(n, seed)
        columns = {"x": x.tolist(), "y": y.tolist(), "id": ids.tolist()}
        stream = Dataset.from_dict(columns).with_format("torch").to_iterable_dataset(num_shards=4)
        return DataLoader(stream, batch_size=BATCH, collate_fn=as_tuples, **common)
    data = TensorDataset(*tensors(n, seed))
    g = torch.Generator().manual_seed(seed)
    if kind == "generator":
        return DataLoader(data, batch_size=BATCH, shuffle=True, generator=g, **common)
    if kind == "shuffle":  # a plain shuffle: its order comes from the seed (use_seedable_sampler)
        return DataLoader(data, batch_size=BATCH, shuffle=True, **common)
    if kind == "weighted":
        sampler = WeightedRandomSampler(torch.linspace(0.2, 1.0, n), n, replacement=True, generator=g)
        return DataLoader(data, batch_size=BATCH, sampler=sampler, **common)
    if kind == "length_grouped":
        from transformers.trainer_pt_utils import LengthGroupedSampler

        lengths = [(i * 7) % 11 + 1 for i in range(n)]
        return DataLoader(data, batch_size=BATCH, sampler=LengthGroupedSampler(BATCH, lengths=lengths, generator=g),
                          **common)
    assert kind == "batch_sampler", kind
    return DataLoader(data, batch_sampler=Buckets(n, g), **common)


def train(kind: str, args: argparse.Namespace) -> Accelerator:
    """Train ``kind``'s loaders from a fresh seed; print its ``RESULT`` line; return its Accelerator."""
    # each process reads its own share (for the datasets stream: its shards, as xshard splits it by node)
    seedable = bool(args.seedable) and kind == "shuffle"
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False,
                                                                        use_seedable_sampler=seedable))
    set_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # 48 training samples: 12 batches, 6 steps per epoch on 2 processes. 37 evaluation samples: a short last
    # round, evened by repeats that gather_for_metrics drops; for the datasets stream 40 (Accelerate's processes
    # would gather batches of unequal sizes at the end otherwise) and for the buckets 24 (Accelerate counts the
    # repeats it drops from the data set's length, which the buckets do not cover when they leave samples out)
    train = loader(kind, 48, 1, args.workers)
    evaluation = loader(kind, {"datasets": 40, "batch_sampler": 24}.get(kind, 37), 2, args.workers)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)

    step = 0
    if args.resume:
        saved = os.path.join(args.resume, kind, "state")
        accelerator.load_state(saved)
        with open(os.path.join(saved, "step.json")) as f:
            step = json.load(f)["step"]
    start_epoch, skip = divmod(step, 48 // (BATCH * accelerator.num_processes))  # a stream has no len()

    losses, read, predictions, evaluated = [], [], [], []
    for epoch in range(start_epoch, 2):
        model.train()
        batches = accelerator.skip_first_batches(train, skip) if epoch == start_epoch and skip else train
        for x, y, ids in batches:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            losses.append(accelerator.gather(loss.detach()[None]).tolist())
            read.append(accelerator.gather(ids).tolist())
            if step == args.save_at:
                folder = os.path.join(args.output_dir, kind, "state")
                accelerator.save_state(folder)
                if accelerator.is_main_process:
                    with open(os.path.join(folder, "step.json"), "w") as f:
                        json.dump({"step": step}, f)
        model.eval()
        with torch.no_grad():
            for x, _, ids in evaluation:
                predictions += accelerator.gather_for_metrics(model(x).squeeze(-1)).tolist()
                evaluated += accelerator.gather_for_metrics(ids).tolist()
    if accelerator.is_main_process:
        print(f"RESULT {kind} " + json.dumps({"losses": losses, "read": read, "predictions": predictions,
                                              "evaluated": evaluated}), flush=True)
    return accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", required=True, help="one kind, or several separated by commas")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--seedable", type=int, default=1, help="use_seedable_sampler (for --kind shuffle)")
    args = parser.parse_args()
    for kind in args.kind.split(","):
        accelerator = train(kind, args)
    accelerator.end_training()
    if os.environ.get("ACCELERATOR") != "xshard":
        # The anchor's results are printed; its interpreter teardown is not what is compared, and Accelerate's
        # process aborts there now and then (SIGABRT with gloo's threads and pyarrow loaded: 2 runs of ~30 in
        # `make test`), which would fail the comparison for a reason outside both programs' training.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
