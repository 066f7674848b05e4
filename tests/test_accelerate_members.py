"""Accelerate's members, each run under stock Accelerate and under xshard on 2 processes, compared one by one.

One job per surface and library: the same snippets (one per member, keyed by the member's name) run under
``accelerate.Accelerator(cpu=True)`` (its multi-CPU data parallel) and under ``xshard.Accelerator(stage=0)``
(unsharded data parallel, the same distributed type), from the same seed; each member's result on each rank
must be equal, or equal to the difference its conformance row states (``DIFFERENT``: Accelerate's value and
xshard's). The conformance rows (``xshard/accelerate_compat/conformance/``) name these tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_workers
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.multiprocess

Snippet = Callable[[Any, Path], Any]


def _plain(value: Any) -> Any:
    """A value two processes' results can be compared by (tensors as their values and dtype)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist(), str(value.dtype))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum) and isinstance(value.value, str):  # an enum of Accelerate's names
        return value.value
    return value


def _split(acc: Any, inputs: Any, apply_padding: bool = False) -> Any:
    with acc.split_between_processes(inputs, apply_padding=apply_padding) as part:
        return part


def _order(acc: Any, folder: Path, context: str) -> str:
    """Who ran the block first: each rank appends its index inside the block."""
    path = folder / f"{context}.txt"
    with getattr(acc, context)():
        with path.open("a") as f:
            f.write(str(acc.process_index))
    acc.wait_for_everyone()
    return path.read_text()


def _printed(acc: Any) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        acc.print("hello", acc.num_processes)
    return out.getvalue()


def _trigger(acc: Any) -> tuple[bool, bool]:
    if acc.process_index == 1:
        acc.set_trigger()
    return acc.check_trigger(), acc.check_trigger()


def _saved(acc: Any, folder: Path) -> Any:
    path = folder / "saved.pt"
    acc.save({"w": torch.arange(4.0)}, path)
    acc.wait_for_everyone()
    return torch.load(path)


def _device_mapped() -> list[torch.nn.Module]:
    """A plain model, one loaded on one device and one spread over two (``from_pretrained``'s ``hf_device_map``)."""
    models = [torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(3)]
    models[1][0].hf_device_map = {"": "cpu"}
    models[2][0].hf_device_map = {"0": "cpu", "1": "disk"}
    return models


def _decorated(acc: Any) -> dict[str, Any]:
    runs = {"on_main_process": acc.on_main_process, "on_local_main_process": acc.on_local_main_process,
            "on_last_process": acc.on_last_process}
    out = {name: decorate(lambda: acc.process_index)() for name, decorate in runs.items()}
    out["on_process"] = acc.on_process(lambda: acc.process_index, process_index=1)()
    out["on_local_process"] = acc.on_local_process(lambda: acc.process_index, local_process_index=1)()
    return out


def _data(n: int = 12) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x.sum(-1, keepdim=True))


def _training(acc: Any, folder: Path) -> dict[str, Any]:
    """A few steps of a prepared model, optimizer, scheduler and loader, and what the members give."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = acc.prepare_model(net), acc.prepare_optimizer(opt)
    loader, sched = acc.prepare_data_loader(DataLoader(_data(), batch_size=2)), acc.prepare_scheduler(sched)
    out: dict[str, Any] = {"losses": [], "norms": [], "lrs": []}
    for x, y in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            out["unscale_gradients"] = acc.unscale_gradients()
            out["norms"].append(round(float(acc.clip_grad_norm_(model.parameters(), 0.5)), 5))
            acc.clip_grad_value_(model.parameters(), 0.05)
            opt.step()
            sched.step()
            opt.zero_grad()
        out["losses"].append(round(loss.item(), 5))
        out["lrs"].append(sched.get_last_lr())
    out["gathered_losses"] = acc.gather_for_metrics(torch.tensor([loss.item()])).shape
    out["unwrap_model"] = type(acc.unwrap_model(model)).__name__
    state = acc.get_state_dict(model)
    out["get_state_dict"] = {k: v.round(decimals=5) for k, v in state.items()} if acc.is_main_process else "elsewhere"
    acc.save_model(model, folder / "model")
    acc.wait_for_everyone()
    out["save_model"] = sorted(p.name for p in (folder / "model").iterdir())
    out["skip_first_batches"] = [b[0].sum().item() for b in acc.skip_first_batches(loader, 4)]
    x, y = next(iter(loader))
    with acc.no_sync(model):
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
    grads = acc.gather(acc.unwrap_model(model).weight.grad.reshape(1, -1))
    out["no_sync"] = torch.equal(grads[0], grads[1])
    opt.zero_grad()
    with acc.no_sync(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss)
    grads = acc.gather(acc.unwrap_model(model).weight.grad.reshape(1, -1))
    out["trigger_sync_in_backward"] = torch.equal(grads[0], grads[1])
    opt.zero_grad()
    with acc.autocast():
        out["autocast"] = torch.is_autocast_enabled("cpu")
    with acc.join_uneven_inputs([model]):
        out["join_uneven_inputs"] = acc.num_processes
    out["free_memory"] = acc.free_memory(model, opt)
    out["clear"] = acc.clear()
    return out


#: one snippet per Accelerator member (some snippets answer for several: ``_training``'s keys)
ACCELERATOR_SNIPPETS: dict[str, Snippet] = {
    **{name: (lambda n: lambda acc, _: getattr(acc, n))(name) for name in (
        "num_processes", "process_index", "local_process_index", "is_main_process", "is_local_main_process",
        "is_last_process", "use_distributed", "multi_device", "distributed_type", "mixed_precision",
        "split_batches", "even_batches", "dispatch_batches", "non_blocking", "use_seedable_sampler",
        "use_stateful_dataloader", "step_scheduler_with_optimizer", "device_placement", "native_amp",
        "sync_gradients", "gradient_accumulation_steps", "optimizer_step_was_skipped", "scaler", "trackers",
        "project_dir", "logging_dir", "save_iteration", "deepspeed_plugin", "is_fsdp2", "step", "profile_handler")},
    "device": lambda acc, _: str(acc.device),
    "state": lambda acc, _: (acc.state.num_processes, acc.state.process_index, acc.state.local_process_index,
                             acc.state.distributed_type.value, acc.state.mixed_precision),
    "state.device": lambda acc, _: str(acc.state.device),
    "gradient_state": lambda acc, _: (acc.gradient_state.sync_gradients, acc.gradient_state.end_of_dataloader,
                                      acc.gradient_state.remainder, acc.gradient_state.in_dataloader,
                                      acc.gradient_state.num_steps),
    "project_configuration": lambda acc, _: tuple(getattr(acc.project_configuration, f) for f in (
        "project_dir", "logging_dir", "automatic_checkpoint_naming", "total_limit", "iteration",
        "save_on_each_node")),
    "dataloader_config": lambda acc, _: tuple(getattr(acc.dataloader_config, f) for f in (
        "split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "data_seed", "non_blocking",
        "use_stateful_dataloader")),
    "wait_for_everyone": lambda acc, _: acc.wait_for_everyone(),
    "main_process_first": lambda acc, folder: _order(acc, folder, "main_process_first"),
    "local_main_process_first": lambda acc, folder: _order(acc, folder, "local_main_process_first"),
    "print": lambda acc, _: _printed(acc),
    "decorators": lambda acc, _: _decorated(acc),
    "split_between_processes": lambda acc, _: (
        _split(acc, list(range(5))), _split(acc, list(range(5)), apply_padding=True),
        _split(acc, torch.arange(6.0).reshape(3, 2)), _split(acc, {"a": [1, 2, 3, 4], "b": torch.arange(4)})),
    "pad_across_processes": lambda acc, _: (
        acc.pad_across_processes(torch.ones(acc.process_index + 1)),
        acc.pad_across_processes(torch.ones(2, acc.process_index + 1), dim=1, pad_index=-1, pad_first=True)),
    "gather": lambda acc, _: acc.gather({"x": torch.tensor([acc.process_index]), "y": [torch.ones(1, 2)]}),
    "reduce": lambda acc, _: (acc.reduce(torch.tensor([1.0 + acc.process_index])),
                              acc.reduce(torch.tensor([1.0 + acc.process_index]), "mean")),
    "gather_for_metrics": lambda acc, _: (acc.gather_for_metrics(["a", acc.process_index], use_gather_object=True),
                                          acc.gather_for_metrics(torch.tensor([acc.process_index]))),
    "check_trigger": lambda acc, _: _trigger(acc),
    "save": lambda acc, folder: _saved(acc, folder),
    "verify_device_map": lambda acc, _: [acc.verify_device_map(m) for m in _device_mapped()],
    "training": _training,
}

#: members whose results differ by design: member -> (Accelerate's result, xshard's), as their rows say
DIFFERENT: dict[str, tuple[Any, Any]] = {
    "dispatch_batches": (None, False),  # Accelerate decides per loader (False for a map-style dataset)
    "use_stateful_dataloader": (False, True),
    "dataloader_config": ([False, None, True, False, None, False, False], [False, False, True, False, None, False,
                                                                            True]),
    "multi_device": (False, True),  # Accelerate's is True for several accelerators only, not MULTI_CPU
    "device": ("cpu:0", "cpu"),
    "state.device": ("cpu:0", "cpu"),
    "batch_size": (None, 2),  # Accelerate's loader is built from a batch sampler, so torch's batch_size is None
    "sampler": ("SequentialSampler", "RankBatches"),
    "batch_sampler": ("BatchSamplerShard", "RankBatches"),
    "get_sampler": ("NoneType", "RankBatches"),  # Accelerate's finds no sampler of its own kind here
}


def _loader_members(acc: Any, folder: Path) -> dict[str, Any]:
    data = TensorDataset(torch.arange(10.0))
    loader = acc.prepare(DataLoader(data, batch_size=2))
    values = {name: getattr(loader, name) for name in (
        "batch_size", "total_batch_size", "total_dataset_length", "num_workers", "drop_last", "pin_memory",
        "pin_memory_device", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers", "generator",
        "in_order", "multiprocessing_context")}
    values.update(
        len=len(loader), passes=[[b[0].tolist() for b in loader] for _ in range(2)], dataset=loader.dataset is data,
        collate_fn=getattr(loader.collate_fn, "__name__", None), device=str(loader.device),
        check_worker_number_rationality=loader.check_worker_number_rationality(),
        base_dataloader=[b[0].tolist() for b in loader.base_dataloader],
        use_stateful_dataloader=loader.use_stateful_dataloader, sampler=type(loader.sampler).__name__,
        batch_sampler=type(loader.batch_sampler).__name__, get_sampler=type(loader.get_sampler()).__name__)
    return values


#: the snippets of each surface (a job runs one surface's, named: lambdas are not sent to the processes)
SURFACES: dict[str, dict[str, Snippet]] = {"accelerator": ACCELERATOR_SNIPPETS, "loader": {"loader": _loader_members}}


def _worker(rank: int, world_size: int, library: str, surface: str, folder: str) -> dict[str, Any]:
    here = Path(folder) / library
    here.mkdir(exist_ok=True)
    if library == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
    else:
        import xshard

        acc = xshard.Accelerator(stage=0)
    results: dict[str, Any] = {}
    for name, snippet in SURFACES[surface].items():
        torch.manual_seed(0)
        value = _plain(snippet(acc, here))
        results.update(value if name in ("training", "decorators", "loader") else {name: value})
    acc.end_training()
    return results


def _compare(surface: str, folder: Path) -> None:
    stock = run_workers(_worker, 2, "accelerate", surface, str(folder), timeout=120)
    ours = run_workers(_worker, 2, "xshard", surface, str(folder), timeout=120)
    unlike = {}
    for rank in (0, 1):
        assert stock[rank].keys() == ours[rank].keys()
        for member, expected in stock[rank].items():
            pair = (expected, ours[rank][member])
            if pair != DIFFERENT.get(member, (expected, expected)):
                unlike[f"rank {rank}: {member}"] = pair
    assert unlike == {}, "members unlike Accelerate's (Accelerate's result, xshard's): " + repr(unlike)


def _defaults(cls: type) -> dict[str, Any]:
    """A configuration dataclass's fields and their defaults."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return _plain(out)


def _draws(module: Any) -> tuple[float, float, float]:
    import random

    import numpy as np

    module.set_seed(7)
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def _utils_names(module: Any) -> dict[str, Any]:
    """What each of ``accelerate.utils``' names that xshard.utils has gives (``module``: either)."""
    out: dict[str, Any] = {}
    for name in UTILS_NAMES:
        value = getattr(module, name)
        if dataclasses.is_dataclass(value):
            out[name] = _defaults(value)
        elif isinstance(value, type) and issubclass(value, enum.Enum):
            out[name] = {m.name: m.value for m in value}
    out["set_seed"] = _draws(module)
    out["send_to_device"] = _plain(module.send_to_device({"a": [torch.ones(2)], "b": (torch.zeros(1), 3)}, "cpu"))
    out["release_memory"] = module.release_memory(torch.ones(1), torch.ones(2))
    out["tqdm"] = list(module.tqdm(range(3), main_process_only=True, disable=True))
    return out


def _utils_worker(rank: int, world_size: int) -> dict[str, Any]:
    import accelerate.utils

    import xshard.utils

    return {"accelerate": _utils_names(accelerate.utils), "xshard": _utils_names(xshard.utils)}


#: accelerate.utils' names that xshard.utils has (the others raise an ImportError naming xshard's way)
UTILS_NAMES = ("AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration", "DeepSpeedPlugin",
               "DistributedDataParallelKwargs", "DistributedType", "FullyShardedDataParallelPlugin",
               "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs", "LoggerType",
               "PrecisionType", "ProfileKwargs", "ProjectConfiguration", "release_memory", "send_to_device",
               "set_seed", "tqdm")


def test_utils_names_match_accelerate():
    """Each name's defaults, values or results as accelerate.utils' (DistributedType: xshard's own names)."""
    [both] = run_workers(_utils_worker, 1, timeout=120)
    stock, ours = both["accelerate"], both["xshard"]
    assert ours.keys() == stock.keys()
    unlike = {name: (stock[name], ours[name]) for name in stock if stock[name] != ours[name]}
    kinds = unlike.pop("DistributedType")
    assert unlike == {}, "names unlike Accelerate's (Accelerate's, xshard's): " + repr(unlike)
    # xshard's distributed types: Accelerate's values where both have the name; MULTI_TPU (TorchTPU) and MULTI_MPS
    # are xshard's own
    assert {k: v for k, v in kinds[1].items() if k in kinds[0]} == {k: v for k, v in kinds[0].items() if k in kinds[1]}
    assert set(kinds[1]) - set(kinds[0]) == {"MULTI_MPS", "MULTI_TPU"}


def test_accelerator_members_match_accelerate(tmp_path):
    _compare("accelerator", tmp_path)


def test_loader_members_match_accelerate(tmp_path):
    _compare("loader", tmp_path)
