"""Accelerate's surface of the Accelerator beyond training: Accelerate's properties, process helpers,
trackers, ``save_model``.

A script written for HF Accelerate reaches these besides ``prepare``, ``backward`` and ``save_state``:
``num_processes``, ``on_main_process``, ``main_process_first``'s local twin, ``init_trackers`` / ``log``,
``save_model``, ``free_memory`` ... ``AccelerateSurface`` is a mixin of ``xshard.Accelerator``; it reads
only the core members ``AcceleratorCore`` declares (``accelerator_core.py``), so the core
(``xshard/accelerator.py``) stays the Accelerator xshard needs to train and this file is Accelerate's.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.rank_logging import progress
from ..runtime.throughput import throughput_values
from . import metrics, profiling, saving, tracking
from .accelerator_state import DistributedType

if TYPE_CHECKING:
    from ..sharding import ShardedModel
    from .accelerator_core import AcceleratorCore
else:  # at run time the surface is a plain mixin: the core members come from xshard.Accelerator
    AcceleratorCore = object


class AccelerateSurface(AcceleratorCore):
    """Accelerate's members of the Accelerator that the core does not need (see the module docstring)."""

    #: raised by ``set_trigger`` on this process, lowered by ``check_trigger`` (the one state the surface owns)
    _flag: torch.Tensor | None = None
    #: the ``ProfileKwargs`` given in ``kwargs_handlers`` (xshard's or Accelerate's), or None
    profile_handler: Any = None

    @property
    def _models(self) -> list[ShardedModel]:
        """The prepared models, under the name Accelerate keeps them (the transformers Trainer reads it)."""
        return self.job.models

    @property
    def distributed_type(self) -> DistributedType:
        """How the job is distributed, in Accelerate's names (``xshard.accelerate_compat.accelerator_state``)."""
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        """Accelerate's name for ``world_size``."""
        return self.world_size

    @property
    def process_index(self) -> int:
        """Accelerate's name for ``rank``."""
        return self.rank

    @property
    def local_process_index(self) -> int:
        """Accelerate's name for ``local_rank``."""
        return self.local_rank

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.job.is_last_process

    @property
    def use_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.job.use_distributed

    @property
    def split_batches(self) -> bool:
        """A loader's ``batch_size`` is the global batch (divided over the processes)."""
        return self.job.split_batches

    @property
    def even_batches(self) -> bool:
        """Always True: the last batch is evened out by repeats that ``gather_for_metrics`` drops."""
        return True

    @property
    def dataloader_config(self) -> Any:
        """How ``prepare`` splits data loaders, as Accelerate's ``DataLoaderConfiguration``: every rank
        reads its own evened samples (``even_batches``), shuffled as Accelerate shuffles (``use_seedable_sampler``),
        with a position that ``save_state`` keeps (``use_stateful_dataloader``)."""
        from .utils import DataLoaderConfiguration

        return DataLoaderConfiguration(split_batches=self.split_batches, dispatch_batches=False, even_batches=True,
                                       use_seedable_sampler=self.use_seedable_sampler,
                                       data_seed=self.accelerate_args.data_seed, non_blocking=self.non_blocking, use_stateful_dataloader=True)

    @property
    def non_blocking(self) -> bool:
        """Batches are copied to the device without waiting (``DataLoaderConfiguration.non_blocking``)."""
        return bool(self.accelerate_args.non_blocking)

    @property
    def dispatch_batches(self) -> bool:
        """Always False: every rank reads its own samples (no batch is dispatched from rank 0)."""
        return False

    @property
    def use_seedable_sampler(self) -> bool:
        """``DataLoaderConfiguration.use_seedable_sampler``: a plain shuffle's order comes from one seed and the
        epoch (True), or from torch's global RNG as Accelerate's default loader draws it (False); either way the
        same order on every rank (``xshard.runtime.batch_order``)."""
        return self.accelerate_args.use_seedable_sampler

    @property
    def use_stateful_dataloader(self) -> bool:
        """Always True: prepared loaders have ``state_dict()`` and their position is checkpointed."""
        return True

    @property
    def step_scheduler_with_optimizer(self) -> bool:
        """The prepared scheduler steps with the optimizer (Accelerate's rule), else on every call."""
        return self.job.step_scheduler_with_optimizer

    @property
    def device_placement(self) -> bool:
        """Always True: prepared loaders put batches on the device."""
        return True

    @property
    def native_amp(self) -> bool:
        """True when the job computes in bf16 or fp16."""
        return self.compute_dtype is not None

    @property
    def deepspeed_plugin(self) -> Any:
        """``state.deepspeed_plugin`` (None unless the config came from DeepSpeed)."""
        return self.state.deepspeed_plugin

    @property
    def is_fsdp2(self) -> bool:
        """True when parameters are sharded (stages 1-3 answer in FSDP2's terms, ``state.fsdp_plugin``)."""
        return self.distributed_type == DistributedType.FSDP

    @property
    def multi_device(self) -> bool:
        """True when the job has more than one process."""
        return self.job.use_distributed

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Accelerate's context for ranks whose loaders yield different numbers of batches. Prepared
        loaders always give every rank the same number of batches (the last one evened out by repeats
        that ``gather_for_metrics`` drops), so no rank waits for a collective the others never reach,
        and the block runs as is. ``even_batches=False`` cannot be honoured and is warned."""
        if even_batches is False and self.is_main_process:
            warnings.warn("join_uneven_inputs(even_batches=False): xshard's prepared loaders always even the last "
                          "batch (gather_for_metrics drops the repeats); the block runs with even batches",
                          stacklevel=3)
        yield

    @property
    def project_dir(self) -> str | None:
        """The project folder (``project_dir`` / ``project_config``)."""
        return getattr(self.project_configuration, "project_dir", None)

    @property
    def logging_dir(self) -> str | None:
        """Where trackers write (default: ``project_dir``)."""
        return getattr(self.project_configuration, "logging_dir", None)

    @property
    def save_iteration(self) -> int:
        """The number of the next automatic checkpoint."""
        return int(getattr(self.project_configuration, "iteration", 0))

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 inf/nan gradients): leave the LR alone."""
        return any(opt.step_was_skipped for opt in self.job.optimizers)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensor(s) along ``dim`` to the largest size on any process, so they can be gathered."""
        return metrics.pad_across_processes(self.backend.collectives, self.device, tensor, dim, pad_index, pad_first)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        """Context manager giving this process its contiguous share of a list, tensor or dict of them."""
        return metrics.split_between_processes(inputs, self.rank, self.world_size, apply_padding)

    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` sees on every process."""
        self._flag = torch.ones((), device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called ``set_trigger`` (then the flag is lowered)."""
        flag = self._flag if self._flag is not None else torch.zeros((), device=self.device)
        raised = bool(self.reduce(flag, "sum").item() >= 1)
        if raised:
            self._flag = None
        return raised

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[torch.profiler.profile]:
        """Profile the block with ``torch.profiler`` as Accelerate does (``accelerate_compat.profiling``):
        ``profile_handler`` (a ``ProfileKwargs``), else the one in ``kwargs_handlers``, else the defaults; with
        ``output_trace_dir`` each process writes ``profile_<process_index>.json`` there after the block."""
        from .utils import ProfileKwargs

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with profiling.profile(handler, self.backend.device_type, self.rank, self.wait_for_everyone) as profiler:
            yield profiler

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on rank 0 first, then on the others (e.g. to download or preprocess once)."""
        return self._first_on(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on each node's local rank 0 first, then on the node's other processes."""
        return self._first_on(self.is_local_main_process)

    @contextlib.contextmanager
    def _first_on(self, first: bool) -> Iterator[None]:
        """The block on the processes where ``first`` is True, then (after a barrier) on the others."""
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    def progress(self, iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
        """A tqdm progress bar shown on the main process only (``xshard.runtime.rank_logging.progress``)."""
        return progress(iterable, **kwargs)

    def _only_on(self, run: bool, function: Callable[..., Any] | None) -> Any:
        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def inner(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if run else None
            return inner
        return decorate if function is None else decorate(function)

    def on_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: the function runs on global rank 0 only (elsewhere it returns None)."""
        return self._only_on(self.is_main_process, function)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: the function runs on each node's local rank 0 only."""
        return self._only_on(self.is_local_main_process, function)

    def on_last_process(self, function: Callable[..., Any] | None = None) -> Any:
        """Decorator: the function runs on the last global rank only."""
        return self._only_on(self.is_last_process, function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        """Decorator: the function runs on global rank ``process_index`` only."""
        return self._only_on(self.rank == process_index, function)

    def on_local_process(self, function: Callable[..., Any] | None = None,
                         local_process_index: int | None = None) -> Any:
        """Decorator: the function runs on local rank ``local_process_index`` of each node only."""
        return self._only_on(self.local_rank == local_process_index, function)

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the ``log_with`` trackers for run ``project_name`` and record ``config`` (main process)."""
        if self.is_main_process:
            self.trackers = tracking.start(self.tracker_choice, project_name, self.logging_dir, config, init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Log ``values`` at ``step`` to every tracker (main process; elsewhere nothing happens), with the
        training throughput since the last log (``throughput/tokens_per_second_per_device``,
        ``throughput/tflops_per_device``, ``throughput/mfu``: ``Accelerator.throughput``) once a step is timed."""
        if self.trackers:
            values = {**throughput_values(self.throughput(), "throughput/"), **values}
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(getattr(tracker, "name", ""), {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The running tracker ``name`` (its library's object with ``unwrap``; a do-nothing one off main)."""
        return tracking.find(self.trackers, name, unwrap)

    def end_training(self) -> None:
        """Finish the trackers (their files are complete), then leave the process group (``end``)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.end()

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save`` on the main process (``safe_serialization``: a safetensors file of tensors)."""
        if self.is_main_process:
            saving.save_object(obj, f, safe_serialization)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's weights (keys as the user's module), complete on the main process and
        empty elsewhere; every process must call it (the shards are gathered)."""
        return self.full_state_dict(model)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike,
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """Write the whole weights as transformers does (``model.safetensors``, or shard files with
        ``model.safetensors.index.json``; ``xshard.accelerate_compat.saving``). Every process must call it."""
        state = self.get_state_dict(model)
        if self.is_main_process:
            saving.write_model(state, save_directory, max_shard_size, safe_serialization)

    def free_memory(self, *objects: Any) -> list[Any]:
        """Forget every prepared object (models' hooks removed), reset the step, collect garbage;
        returns one None per object (``model, optimizer = accelerator.free_memory(model, optimizer)``)."""
        from .utils import release_memory

        self.close_models()
        for kept in (self.job.models, self.job.optimizers, self.job.schedulers, self.job.loaders):
            kept.clear()
        self.job.step = self.job.micro_step = 0
        self.job.sync_gradients = True
        return release_memory(*objects, backend=self.backend)

    clear = free_memory

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True when ``model`` or a module in it was loaded spread over several devices (a ``device_map`` of more
        than one entry, as ``from_pretrained(device_map="auto")`` leaves in ``hf_device_map``), as Accelerate
        checks before training such a model."""
        return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())
