"""Accelerate's behaviours on 2 real processes, checked as Accelerate's own test scripts check them.

Modelled on the accelerate repository's gradient-sync, scheduler, metrics and state-checkpointing
test scripts (behaviour only; written for xshard):

- sync points: with accumulation 2, the window ends every second micro-step and at the end of the
  loader (``sync_with_dataloader``), or not at the end of the loader when that is turned off;
- ``no_sync``: gradients differ between processes inside it and agree after the next synced backward;
- clipping inside a window clips this process's accumulated gradients and returns their norm;
- the scheduler steps once per process per optimizer step (once with ``split_batches``, on every call
  with ``step_scheduler_with_optimizer=False``);
- ``gather_for_metrics`` returns each of 37 samples exactly once, in the loader's order (tensors and
  objects, in order or shuffled, with ``split_batches``); ``pad_across_processes`` evens out lengths;
- automatic checkpoint naming keeps ``total_limit`` folders, restores registered objects, and loads
  the newest without a folder name.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.multiprocess


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(3, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(self.blocks(x)).squeeze(-1), y)


def _data(n: int = 20) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x.sum(-1))


def _counting_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + s)  # lr / base lr - 1 = steps taken


def _sync_worker(rank, world_size):
    import xshard
    from xshard.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    out = {}
    # sync points; 20 samples, batch 2, 2 processes: 5 micro-steps per process
    for name, kwargs in (("with_loader", {"gradient_accumulation_steps": 2}),
                         ("without_loader", {"gradient_accumulation_plugin": GradientAccumulationPlugin(
                             num_steps=2, sync_with_dataloader=False)})):
        acc = xshard.Accelerator(stage=0, seed=0, **kwargs)
        model, loader = acc.prepare(Net(), DataLoader(_data(), batch_size=2))
        flags = []
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(model(x, y))
                flags.append((acc.sync_gradients, acc.gradient_state.end_of_dataloader))
        out[name] = flags

    # no_sync at stage 0: local gradients differ, the next synced backward makes them agree
    acc = xshard.Accelerator(stage=0, seed=0)
    model, loader = acc.prepare(Net(), DataLoader(_data(), batch_size=2))
    x, y = next(iter(loader))
    with acc.no_sync(model):
        acc.backward(model(x, y))
    local = acc.gather(model.head.weight.grad.reshape(1, -1))
    acc.backward(model(x, y))
    synced = acc.gather(model.head.weight.grad.reshape(1, -1))
    out["no_sync"] = (torch.equal(local[0], local[1]), torch.equal(synced[0], synced[1]))

    # clipping inside a window (stage 3): this process's accumulated full gradients, their local norm
    acc = xshard.Accelerator(stage=3, seed=0, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    plain = Net()
    model = acc.prepare(Net())
    plain.load_state_dict({k: v for k, v in acc.get_state_dict(model).items()} if rank == 0 else
                          _state_from_rank0(acc, model))
    x, y = _data()[rank * 2:rank * 2 + 2]
    with acc.accumulate(model):
        acc.backward(model(x, y))
        norm = acc.clip_grad_norm_(model.parameters(), 1e-3)
    (plain(x, y) / 2).backward()
    out["window_norm"] = (norm.item(), torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3).item())

    # scheduler steps: accumulation 4 over 4 micro-steps per process = 1 optimizer step
    for name, kwargs in (("default", {}), ("split_batches", {"dataloader_config": DataLoaderConfiguration(
            split_batches=True)}), ("every_call", {"step_scheduler_with_optimizer": False})):
        acc = xshard.Accelerator(stage=2, seed=0, gradient_accumulation_steps=4, **kwargs)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        batch = 4 if kwargs.get("dataloader_config") else 2
        model, opt, loader, sched = acc.prepare(net, opt, DataLoader(_data(16), batch_size=batch),
                                                _counting_scheduler(opt))
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(model(x, y))
                opt.step()
                sched.step()
                opt.zero_grad()
        out["sched_" + name] = (sched.scheduler.last_epoch, round(sched.get_last_lr()[0] / 0.1 - 1, 6),
                                acc.optimizer_step_was_skipped)
    acc.end()
    return out


def _state_from_rank0(acc, model):
    state = acc.get_state_dict(model)  # every rank takes part; complete on rank 0 only
    assert state == {}
    return {k: v for k, v in Net().state_dict().items()}  # rank 1 compares nothing (see the test)


def test_sync_points_no_sync_window_clipping_and_scheduler_steps():
    results = run_workers(_sync_worker, 2)
    for out in results:
        # the end of the loader closes the window (micro-step 5), unless sync_with_dataloader=False
        assert out["with_loader"] == [(False, False), (True, False), (False, False), (True, False), (True, True)]
        assert [s for s, _ in out["without_loader"]] == [False, True, False, True, False]
        assert out["no_sync"] == (False, True)
        assert out["sched_default"] == (2, 2.0, False)  # 1 optimizer step x 2 processes
        assert out["sched_split_batches"] == (1, 1.0, False)
        assert out["sched_every_call"] == (4, 4.0, False)  # 4 calls
    norm, plain_norm = results[0]["window_norm"]
    assert norm == pytest.approx(plain_norm, rel=1e-5)  # rank 0: same weights, same micro-batch


def _metrics_worker(rank, world_size):
    import xshard
    from xshard.utils import DataLoaderConfiguration

    out = {}
    ids = TensorDataset(torch.arange(37))
    for name, kwargs, shuffle, batch in (("ordered", {}, False, 4), ("shuffled", {}, True, 4),
                                         ("split", {"dataloader_config": DataLoaderConfiguration(
                                             split_batches=True)}, False, 8)):
        acc = xshard.Accelerator(stage=0, seed=0, **kwargs)
        loader = acc.prepare(DataLoader(ids, batch_size=batch, shuffle=shuffle))
        plain, metric, objects, scalars, repeated = [], [], [], [], []
        for (x,) in loader:
            plain.append(acc.gather(x))
            metric.append(acc.gather_for_metrics(x))
            objects += acc.gather_for_metrics([f"s{int(v)}" for v in x])
            scalars.append(acc.gather_for_metrics(x.float().mean()))
            # the transformers examples' evaluation pattern: a per-rank mean repeated batch_size times
            repeated.append(acc.gather_for_metrics(x.float().mean().repeat(batch)))
        out[name] = (torch.cat(plain).tolist(), torch.cat(metric).tolist(), objects, scalars[-1].numel())
        out[name + "_repeated"] = torch.cat(repeated).tolist()
    mine = torch.arange(rank + 1) + 1
    out["pad"] = (acc.pad_across_processes(mine).tolist(), acc.pad_across_processes(mine, pad_first=True).tolist())
    acc.end()
    return out


def test_gather_for_metrics_returns_every_sample_once():
    results = run_workers(_metrics_worker, 2)
    for out in results:
        for name in ("ordered", "shuffled", "split"):
            plain, metric, objects, last_scalars = out[name]
            assert len(plain) == 40  # gather keeps the samples repeated to even out the last batches
            assert sorted(metric) == list(range(37)), name
            assert sorted(objects, key=lambda s: int(s[1:])) == [f"s{i}" for i in range(37)]
            assert last_scalars == 2  # one value per process is not per-sample: nothing is cut
        # in the data set's order (rank 0 holds batches 0, 2, 4 ..., rank 1 holds batches 1, 3, 5 ...)
        assert out["ordered"][1] == list(range(37)) and out["split"][1] == list(range(37))
        assert out["ordered"][2] == [f"s{i}" for i in range(37)]
        # loss.repeat(batch_size): each rank's mean kept once per real sample behind it (Accelerate's cut),
        # the last batch (ranks hold 32..35 and 36 + the repeated 0, 1, 2) gives 4 + 1 values, not 8
        repeated = out["ordered_repeated"]
        assert len(repeated) == 37
        assert sum(repeated) == pytest.approx(sum(range(32)) + 4 * (32 + 33 + 34 + 35) / 4 + 1 * (36 + 0 + 1 + 2) / 4)
    assert results[0]["pad"] == ([1, 0], [0, 1]) and results[1]["pad"] == ([1, 2], [1, 2])


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _naming_worker(rank, world_size, root):
    import xshard
    from xshard.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True, total_limit=2)
    acc = xshard.Accelerator(stage=3, seed=0, project_config=config)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    net = Net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    saved = []
    for n in range(3):
        counter.n = n
        saved.append(acc.save_state().name)
    kept = sorted(p.name for p in (root / "checkpoints").iterdir() if p.is_dir())  # not the running job's lock
    counter.n = -1
    loaded = acc.load_state().name
    result = (saved, kept, loaded, counter.n, acc.save_iteration)
    acc.end()
    return result


def test_automatic_checkpoint_naming_with_a_total_limit(tmp_path):
    for saved, kept, loaded, n, iteration in run_workers(_naming_worker, 2, tmp_path):
        assert saved == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
        assert kept == ["checkpoint_1", "checkpoint_2"]
        assert loaded == "checkpoint_2" and n == 2 and iteration == 3
