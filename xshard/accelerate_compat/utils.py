"""What training scripts import from ``accelerate.utils``, for the same scripts on xshard.

``from accelerate.utils import set_seed, ProjectConfiguration`` becomes
``from xshard.utils import set_seed, ProjectConfiguration``. The configuration classes take
Accelerate's field names and defaults; ``xshard.Accelerator`` also accepts Accelerate's own objects
of the same names (it reads their fields), so a script that still imports them from ``accelerate``
keeps working. What each field does in xshard is in docs/accelerate-scripts.md.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from ..config.project_configuration import ProjectConfiguration
from ..runtime.data import move_to_device
from ..runtime.rank_logging import progress as tqdm
from .accelerator_state import DistributedType

if TYPE_CHECKING:
    from ..backends import Backend

__all__ = [
    "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration", "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType", "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
    "InitProcessGroupKwargs", "LoggerType", "PrecisionType", "ProjectConfiguration", "release_memory",
    "send_to_device", "set_seed", "tqdm",
    "ProfileKwargs",
]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, numpy, torch and the selected backend's device generators.

    ``device_specific`` adds this process's rank (torchrun's ``RANK``) to the seed, so each rank
    draws different numbers; ``deterministic`` turns on ``torch.use_deterministic_algorithms``.
    """
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    from ..backends import select

    select().cls().manual_seed(seed)  # torch's generator and the device's (cuda, npu, xla ...)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def send_to_device(tensor: Any, device: torch.device | str, non_blocking: bool = False,
                   skip_keys: list[str] | str | None = None) -> Any:
    """Move every tensor in nested dicts/lists/tuples to ``device`` (keys in ``skip_keys`` stay put)."""
    if skip_keys and isinstance(tensor, dict):
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
        return type(tensor)({k: v if k in skip else move_to_device(v, torch.device(device), non_blocking)
                             for k, v in tensor.items()})
    return move_to_device(tensor, torch.device(device), non_blocking)


def release_memory(*objects: Any, backend: Backend | None = None) -> list[Any]:
    """Drop references to ``objects``, collect garbage and empty the device cache; returns Nones.

    Use as ``a, b = release_memory(a, b)`` (the caller's names are the references that matter). The cache is
    ``backend``'s (``Backend.empty_cache``; the Accelerator passes its own), else the one this process selects
    (``XSHARD_BACKEND`` or ``auto``).
    """
    result: list[Any] = [None] * len(objects)
    gc.collect()
    if backend is None:
        from ..backends import select

        backend = select().cls()
    backend.empty_cache()
    return result


class LoggerType(str, Enum):
    """Tracker names for ``Accelerator(log_with=...)`` (see ``xshard.tracking``)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    COMETML = "comet_ml"
    AIM = "aim"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


class PrecisionType(str, Enum):
    """``mixed_precision`` values."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` splits data loaders (Accelerate's ``DataLoaderConfiguration``).

    ``split_batches``: the loader's ``batch_size`` is the global batch, divided over the processes
    (it must divide evenly). ``even_batches``: xshard always evens the last batch by wrapping
    around, and ``gather_for_metrics`` drops the repeated samples. ``data_seed``: the shuffle seed.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class GradientAccumulationPlugin:
    """Accumulation settings (Accelerate's ``GradientAccumulationPlugin``).

    ``num_steps``: micro-steps per optimizer step. ``adjust_scheduler``: count skipped scheduler
    calls inside a window in ``scheduler._step_count``. ``sync_with_dataloader``: the last batch of
    an epoch closes the window. ``sync_each_batch``: reduce gradients on every micro-step (less
    memory for held gradients, more communication; same result).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class InitProcessGroupKwargs:
    """Process-group settings: ``timeout`` is used; the backend comes from xshard's device layer."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclass
class GradScalerKwargs:
    """fp16 loss-scaler settings, passed to xshard's grad scaler."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


class DDPCommunicationHookType(str, Enum):
    """DDP's gradient communication hooks, for ``DistributedDataParallelKwargs(comm_hook=...)``.

    At stage 0, FP16 / BF16 compress each gradient bucket to that dtype for the all-reduce, with
    torch's arithmetic (cast, divide by the world size, sum, cast back); POWER_SGD and
    BATCHED_POWER_SGD are named in a warning (xshard all-reduces uncompressed).
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs:
    """DDP settings: ``bucket_cap_mb`` sets stage 0's bucket size, ``comm_hook`` FP16 / BF16 its
    all-reduce dtype; what xshard does with each field is in docs/accelerate-scripts.md."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)


@dataclass
class AutocastKwargs:
    """``Accelerator.autocast`` settings: ``enabled=False`` turns autocast off."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class FullyShardedDataParallelPlugin:
    """FSDP settings in Accelerate's names, mapped onto xshard's config when given to the Accelerator.

    ``sharding_strategy`` FULL_SHARD / SHARD_GRAD_OP / NO_SHARD (or 1 / 2 / 3) -> stage 3 / 2 / 0,
    HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (or 4 / 5) -> stage 3 / 2 sharded within each node;
    ``reshard_after_forward`` (FSDP2) True / False -> stage 3 / 2, an int k -> stage 3 with backward
    gathering within groups of k ranks; ``cpu_offload`` -> offload;
    ``auto_wrap_policy`` "transformer_based_wrap" / "size_based_wrap" / "no_wrap" (a policy
    function is not used: units follow ``transformer_cls_names_to_wrap`` or the model's
    ``_no_split_modules``); ``backward_prefetch``, ``forward_prefetch``, ``state_dict_type``,
    ``activation_checkpointing``, ``sync_module_states``, ``min_num_params``,
    ``cpu_ram_efficient_loading`` (rank 0's weights are broadcast, as ``sync_module_states``).
    ``state_dict_config``, ``optim_state_dict_config``, ``ignored_modules``, ``param_init_fn``,
    ``activation_checkpointing_offload`` and ``limit_all_gathers=False`` are accepted and named in
    one warning when set.
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings in Accelerate's names, mapped onto xshard's config.

    ``hf_ds_config``: a ds_config.json path or dict (read as xshard reads DeepSpeed files, its
    ``"auto"`` values filled from the Accelerator's arguments and the prepared data loader);
    ``zero_stage``, ``gradient_accumulation_steps``, ``gradient_clipping``,
    ``offload_optimizer_device`` / ``offload_param_device`` ("cpu" or "none"),
    ``zero3_save_16bit_model`` (True: full checkpoints, False: sharded). The NVMe paths,
    ``zero3_init_flag``, ``transformer_moe_cls_names``, MS-AMP and ``is_train_batch_min=False`` are
    accepted and named in one warning when set.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None


def __getattr__(name: str) -> Any:
    """Accelerate's ``accelerate.utils`` names that xshard lacks: an ImportError naming xshard's way
    (``missing.UTILS_NAMES``); ``xshard.utils`` re-exports this too (it is in ``__all__``)."""
    from .missing import UTILS_NAMES, missing_name

    raise missing_name("xshard.utils", name, UTILS_NAMES)


__all__ += ["__getattr__"]  # so that xshard.utils' star import takes it


@dataclass
class ProfileKwargs:
    """What ``accelerator.profile()`` records (Accelerate's fields and defaults; ``accelerate_compat.profiling``).

    ``activities``: names, ``"cpu"`` always, ``"cuda"`` on the cuda backend (None: torch's default);
    ``schedule_option``: ``torch.profiler.schedule``'s keywords (``wait``, ``warmup``, ``active``, ``repeat``,
    ``skip_first``); ``output_trace_dir``: each process writes ``profile_<process_index>.json`` there.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The ``torch.profiler.profile`` these fields describe, for the selected backend's device family."""
        from ..backends import select
        from .profiling import build_profiler

        return build_profiler(self, select().cls.device_type)
