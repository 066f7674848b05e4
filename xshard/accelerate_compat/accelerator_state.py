"""Accelerate's state objects, answered from one xshard job.

Scripts written for Accelerate read ``accelerator.state`` (``distributed_type``, ``num_processes``,
``fsdp_plugin`` ...) and ``accelerator.gradient_state`` (``sync_gradients``, ``end_of_dataloader``).
Here they are views: every answer is read from the Accelerator's ``JobState`` and ``XShardConfig``
when asked, so nothing can disagree with what the job does.

``distributed_type``: ``FSDP`` at stages 1-3 (xshard shards as FSDP does), ``DEEPSPEED`` when the
config came from DeepSpeed (a ds_config, a DeepSpeedPlugin, an accelerate yaml with
``distributed_type: DEEPSPEED``), otherwise plain data parallel in Accelerate's device names
(``MULTI_CPU``, ``MULTI_GPU``, ``MULTI_NPU``, ``XLA``; ``MULTI_TPU`` for TorchTPU) or ``NO`` for one process.

``share_with_accelerate`` tells an imported Accelerate the same facts (see its docstring): the
transformers ``*_no_trainer`` examples log through ``accelerate.logging.get_logger``, which asks
Accelerate's ``PartialState`` which process it is in.
"""

from __future__ import annotations

import re
import sys
import warnings
from enum import Enum
from typing import TYPE_CHECKING, Any, cast

__all__ = ["AcceleratorState", "DeepSpeedPluginView", "DistributedType", "FSDPPluginView", "GradientState",
           "share_with_accelerate", "unshare_with_accelerate"]

if TYPE_CHECKING:
    from ..runtime.job import JobState


class DistributedType(str, Enum):
    """Accelerate's names for how a job is distributed (the ones xshard can be)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MPS = "MULTI_MPS"
    MULTI_TPU = "MULTI_TPU"  # TorchTPU's eager tpu device (Accelerate's XLA means torch_xla, which it is not)
    XLA = "XLA"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"

    @classmethod
    def _missing_(cls, value: object) -> DistributedType | None:
        """``MULTI_<FAMILY>`` for a device family declared by its backend alone (Accelerate's MULTI_XPU, MULTI_HPU
        ..., a backend from outside xshard): one member per name, made when first asked for."""
        if isinstance(value, str) and re.fullmatch(r"MULTI_[A-Z][A-Z0-9_]*", value):
            member = str.__new__(cls, value)
            member._name_ = member._value_ = value
            return cast("DistributedType", cls._value2member_map_.setdefault(value, member))
        return None


def data_parallel_type(backend: Any) -> DistributedType:
    """Plain data parallel on ``backend``'s devices, in Accelerate's word for them (the backend's
    ``accelerate_distributed_type()``)."""
    return DistributedType(backend.accelerate_distributed_type())


class FSDPPluginView:
    """``accelerator.state.fsdp_plugin``: the job's sharding in FSDP's words (stages 1-3).

    Reading gives torch FSDP's enums (``ShardingStrategy.FULL_SHARD`` ...). Assigning, before
    ``prepare``, changes the config: ``state_dict_type``, ``transformer_cls_names_to_wrap``,
    ``min_num_params``, ``activation_checkpointing``, ``cpu_offload``, and ``auto_wrap_policy`` as
    a name. A policy *function* (e.g. ``peft.utils.other.fsdp_auto_wrap_policy(model)``) is kept
    but not called: xshard's units follow ``transformer_cls_names_to_wrap`` (default: the model's
    ``_no_split_modules``), which is what such policies wrap; the result is the same, a warning
    says so once.
    """

    _STRATEGY = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP", 1: "SHARD_GRAD_OP", 0: "NO_SHARD"}
    # shard_group_size set: hybrid sharding (which the config refuses at stage 0)
    _HYBRID_STRATEGY = {3: "HYBRID_SHARD", 2: "_HYBRID_SHARD_ZERO2", 1: "_HYBRID_SHARD_ZERO2", 0: "NO_SHARD"}
    _PREFETCH = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST", "none": None}
    _STATE_DICT = {"full": "FULL_STATE_DICT", "local": "LOCAL_STATE_DICT", "sharded": "SHARDED_STATE_DICT"}
    _WRAP = {"transformer": "transformer_based_wrap", "size": "size_based_wrap", "none": "no_wrap"}

    # set with object.__setattr__ (this class's own __setattr__ writes the config)
    _config: Any
    _policy: Any

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_policy", None)

    @property
    def fsdp_version(self) -> int:
        return 2  # per-parameter dim-0 shards, as FSDP2

    @property
    def sharding_strategy(self) -> Any:
        from torch.distributed.fsdp import ShardingStrategy

        names = self._STRATEGY if self._config.shard_group_size is None else self._HYBRID_STRATEGY
        return ShardingStrategy[names[int(self._config.stage)]]

    @property
    def reshard_after_forward(self) -> bool | int:
        """FSDP2's value: the config's (True / False / a group size), else the stage's default."""
        from ..sharding.plan import ShardingPlan

        value = self._config.reshard_after_forward
        return ShardingPlan.for_stage(self._config.stage).reshard_after_forward.frees if value is None else value

    @property
    def backward_prefetch(self) -> Any:
        from torch.distributed.fsdp import BackwardPrefetch

        name = self._PREFETCH[self._config.backward_prefetch]
        return None if name is None else BackwardPrefetch[name]

    @property
    def forward_prefetch(self) -> bool:
        return bool(self._config.forward_prefetch)

    @property
    def state_dict_type(self) -> Any:
        from torch.distributed.fsdp import StateDictType

        return StateDictType[self._STATE_DICT[self._config.state_dict_type]]

    @property
    def cpu_offload(self) -> Any:
        from torch.distributed.fsdp import CPUOffload

        return CPUOffload(offload_params=bool(self._config.offload_params))

    @property
    def auto_wrap_policy(self) -> Any:
        return self._policy if self._policy is not None else self._WRAP[self._config.auto_wrap_policy]

    @property
    def transformer_cls_names_to_wrap(self) -> list[str] | None:
        return self._config.transformer_layer_cls_to_wrap

    @property
    def min_num_params(self) -> int:
        return int(self._config.min_num_params)

    @property
    def activation_checkpointing(self) -> bool:
        return bool(self._config.activation_checkpointing)

    @property
    def sync_module_states(self) -> bool:
        return bool(self._config.sync_module_states)

    @property
    def use_orig_params(self) -> bool:
        return True  # the user's Parameter objects always stay valid

    @property
    def mixed_precision_policy(self) -> Any:
        return None if self._config.mixed_precision == "no" else self._config.mixed_precision

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Accelerate's setter: FULL_STATE_DICT / SHARDED_STATE_DICT / LOCAL_STATE_DICT (or enums)."""
        if state_dict_type is not None:
            self.state_dict_type = state_dict_type  # type: ignore[misc]  # __setattr__ below writes it

    def __setattr__(self, name: str, value: Any) -> None:
        from ..config.fsdp import STATE_DICT, WRAP
        from ..config.values import parse_bool, parse_choice, parse_int, parse_names

        config = self._config
        text = getattr(value, "name", value)  # torch enums by name
        if name == "auto_wrap_policy":
            if callable(value) and not isinstance(value, str):
                object.__setattr__(self, "_policy", value)
                _warn_once("fsdp_plugin.auto_wrap_policy was given a policy function: xshard does not call it; "
                           "its units are the classes in transformer_cls_names_to_wrap (from the config; default: "
                           "the model's _no_split_modules), which is what such policies wrap")
            else:
                config.auto_wrap_policy = parse_choice(name, text, WRAP)
        elif name == "state_dict_type":
            config.state_dict_type = parse_choice(name, text, STATE_DICT)
        elif name == "transformer_cls_names_to_wrap":
            config.transformer_layer_cls_to_wrap = parse_names(name, value) or None
        elif name == "min_num_params":
            config.min_num_params = parse_int(name, value, 1)
        elif name == "activation_checkpointing":
            config.activation_checkpointing = parse_bool(name, value)
        elif name == "cpu_offload":
            offload = bool(getattr(value, "offload_params", value))
            config.offload_params = config.offload_optimizer = offload
        else:
            raise AttributeError(f"fsdp_plugin.{name} cannot be changed on xshard; set it in the config file "
                                 "(xshard config --help lists the fields)")

    def __repr__(self) -> str:
        return (f"FSDPPluginView(sharding_strategy={self.sharding_strategy.name}, "
                f"state_dict_type={self.state_dict_type.name}, offload_params={self._config.offload_params})")


class DeepSpeedPluginView:
    """``accelerator.state.deepspeed_plugin`` when the config came from DeepSpeed.

    ``deepspeed_config`` is the ds_config as xshard resolved it (``"auto"`` values filled, the
    micro-batch once a data loader is prepared, the accumulation a script set with
    ``accelerator.gradient_accumulation_steps = n``); ``zero_stage``, ``gradient_accumulation_steps``,
    ``gradient_clipping`` are read from the job's config.
    """

    def __init__(self, config: Any, ds_config: dict[str, Any]) -> None:
        self._config = config
        self._ds_config = ds_config

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The resolved ds_config, its accumulation (and ``train_batch_size`` with it) the job's current one."""
        ds, steps = self._ds_config, int(self._config.gradient_accumulation_steps)
        shown = ds.get("gradient_accumulation_steps")
        if isinstance(shown, int) and shown != steps:
            if isinstance(ds.get("train_batch_size"), int):
                ds["train_batch_size"] = ds["train_batch_size"] // shown * steps
            ds["gradient_accumulation_steps"] = steps
        return ds

    @property
    def zero_stage(self) -> int:
        return int(self._config.stage)

    @property
    def gradient_accumulation_steps(self) -> int:
        return int(self._config.gradient_accumulation_steps)

    @property
    def gradient_clipping(self) -> float:
        return float(self._config.gradient_clipping or 0.0)

    @property
    def offload_optimizer_device(self) -> str:
        return "cpu" if self._config.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> str:
        return "cpu" if self._config.offload_params else "none"

    def get_value(self, key: str, default: Any = None) -> Any:
        """A dotted key of ``deepspeed_config`` (``"zero_optimization.stage"``)."""
        node: Any = self.deepspeed_config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


class AcceleratorState:
    """``accelerator.state``: where this process sits and how the job is distributed."""

    def __init__(self, accelerator: Any, origin: str, ds_config: dict[str, Any] | None) -> None:
        self._acc = accelerator
        #: where this process sits: the job's facts, asked of its ``JobState`` (their one owner)
        self._job: JobState = accelerator.job
        self._origin = origin
        self._fsdp = FSDPPluginView(accelerator.config)
        self._ds = DeepSpeedPluginView(accelerator.config, ds_config or {}) if origin == "deepspeed" else None

    @property
    def distributed_type(self) -> DistributedType:
        acc = self._acc
        if self._origin == "deepspeed":
            return DistributedType.DEEPSPEED
        from ..sharding.plan import ShardingPlan

        if ShardingPlan.for_stage(acc.config.stage).shard_parameters:
            return DistributedType.FSDP
        if not self._job.use_distributed:
            return DistributedType.NO
        return data_parallel_type(acc.backend)

    @property
    def fsdp_plugin(self) -> FSDPPluginView | None:
        return self._fsdp if self.distributed_type == DistributedType.FSDP else None

    @property
    def deepspeed_plugin(self) -> DeepSpeedPluginView | None:
        return self._ds

    @property
    def num_processes(self) -> int:
        return self._job.world_size

    @property
    def process_index(self) -> int:
        return self._job.rank

    @property
    def local_process_index(self) -> int:
        return self._job.local_rank

    @property
    def device(self) -> Any:
        return self._job.device

    @property
    def mixed_precision(self) -> str:
        return self._acc.mixed_precision

    @property
    def backend(self) -> str | None:
        return self._acc.backend.dist_backend

    @property
    def is_main_process(self) -> bool:
        return self._job.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._job.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self._job.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self._job.use_distributed

    def wait_for_everyone(self) -> None:
        self._job.barrier()

    @property
    def is_fsdp2(self) -> bool:
        """True at stages 1-3 (sharded in FSDP2's way: per-parameter dim-0 shards)."""
        return self.distributed_type == DistributedType.FSDP

    @property
    def initialized(self) -> bool:
        """Always True: the view exists once the Accelerator does."""
        return True

    @property
    def fork_launched(self) -> bool:
        """Always False: processes are started by ``xshard launch`` / torchrun, not forked from a notebook."""
        return False

    @property
    def debug(self) -> bool:
        """Always False (Accelerate's ``ACCELERATE_DEBUG_MODE`` has no xshard counterpart)."""
        return False

    @property
    def dynamo_plugin(self) -> Any:
        """The ``TorchDynamoPlugin`` ``prepare`` compiles each model with (backend ``NO``: none), as Accelerate's
        state holds it (``xshard.config.dynamo``)."""
        return self._acc.accelerate_args.dynamo

    @property
    def megatron_lm_plugin(self) -> None:
        """None: no tensor or pipeline parallelism."""
        return None

    @property
    def torch_tp_plugin(self) -> None:
        """None: no tensor parallelism."""
        return None

    @property
    def parallelism_config(self) -> None:
        """None: data parallelism (sharded or not) only."""
        return None

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Accelerate's reset before building another Accelerator: nothing to do here, every answer is
        read from the Accelerator that owns this view."""

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave the process group at the end of the script (the Accelerator's ``end``)."""
        self._acc.end()

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\nMixed precision type: {self.mixed_precision}\n")


class GradientState:
    """``accelerator.gradient_state``: the accumulation window and the data loader being iterated."""

    def __init__(self, job: JobState) -> None:
        self._job = job

    @property
    def sync_gradients(self) -> bool:
        return self._job.sync_gradients

    @property
    def num_steps(self) -> int:
        return self._job.gradient_accumulation_steps

    @property
    def adjust_scheduler(self) -> bool:
        return self._job.adjust_scheduler

    @property
    def sync_with_dataloader(self) -> bool:
        return self._job.sync_with_dataloader

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        job = self._job
        return {"num_steps": job.gradient_accumulation_steps, "adjust_scheduler": job.adjust_scheduler,
                "sync_with_dataloader": job.sync_with_dataloader, "sync_each_batch": job.sync_each_batch}

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Say whether this micro-step ends the accumulation window (Accelerate's setter; the
        transformers Trainer counts its window itself and calls it before each micro-step)."""
        self._job.sync_gradients = bool(sync_gradients)

    @property
    def active_dataloader(self) -> Any:
        return self._job.active_loader()

    @property
    def in_dataloader(self) -> bool:
        return self._job.active_loader() is not None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self._job.active_loader()
        return bool(loader is not None and loader.end_of_epoch)

    @property
    def remainder(self) -> int:
        """The active loader's ``remainder`` (-1 outside a loader), as Accelerate's."""
        loader = self._job.active_loader()
        return -1 if loader is None else loader.remainder


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


#: a key of ours in Accelerate's shared process facts: they were filled from an xshard job
_SHARED_MARK = "_filled_by_xshard"
_ACCELERATE_FIX = ("use `from xshard.logging import get_logger` in place of `from accelerate.logging import "
                   "get_logger` (same arguments and keywords)")


def share_with_accelerate(accelerator: Any) -> bool:
    """Fill Accelerate's ``PartialState`` and ``AcceleratorState`` with this job's facts when the script
    imported Accelerate.

    Design note: ``accelerate.logging.get_logger`` (every transformers ``*_no_trainer`` example logs
    through it) raises "You must initialize the accelerate state" at its first line unless
    Accelerate's ``PartialState`` holds this process's rank, world size, device and distributed
    type, and Accelerate's helpers read ``AcceleratorState()``. Those are facts of the job, which
    xshard knows, so Accelerate's objects are made to answer for it rather than asking the user to
    edit every script: the fields Accelerate itself lists (``_known_attrs``) are filled, in place,
    in its shared dicts; ``PartialState().wait_for_everyone`` (``in_order`` logging) then runs over
    the process group xshard started. Nothing is done when Accelerate is not imported
    (``import xshard`` never imports it), or when a real Accelerate state already exists. An
    Accelerate whose state is laid out otherwise gets a warning naming the one-line fix instead.
    Returns True when the facts were filled.
    """
    module = sys.modules.get("accelerate.state")
    if module is None:
        return False
    partial = getattr(getattr(module, "PartialState", None), "_shared_state", None)
    full = getattr(getattr(module, "AcceleratorState", None), "_shared_state", None)
    accelerate_types = getattr(module, "DistributedType", None)
    if not isinstance(partial, dict) or not isinstance(full, dict) or accelerate_types is None:
        _warn_once("accelerate.state is laid out differently from the Accelerate versions xshard knows, so "
                   "accelerate.logging.get_logger will not find this job's processes: " + _ACCELERATE_FIX)
        return False
    # Accelerate's own process state (the script built one, or transformers' TrainingArguments did) is left
    # alone; its AcceleratorState, which only an ``accelerate.Accelerator`` fills, is filled when empty: TRL's
    # GRPOTrainer calls ``accelerate.utils.set_seed(device_specific=True)``, which reads it
    own_partial = bool(partial) and not partial.get(_SHARED_MARK)
    if own_partial and (partial.get("num_processes"), partial.get("process_index")) != (accelerator.world_size,
                                                                                        accelerator.rank):
        # built for another world (one process, before this job joined it): Accelerate's free functions would
        # act alone on every rank (TRL's GRPOTrainer gathers its rewards with accelerate.utils.gather)
        own_partial = False
    if own_partial and full:
        return False
    ours = accelerator.state.distributed_type
    distributed_type = getattr(accelerate_types, ours.value, None) or (
        accelerate_types.NO if accelerator.world_size == 1 else accelerate_types.MULTI_CPU)
    # ``_cpu`` (Accelerate's ``cpu=True``) is read only to pick a device when none is set; ``device`` is.
    facts = {
        "_cpu": False, "_mixed_precision": accelerator.mixed_precision,
        "backend": accelerator.backend.dist_backend, "debug": False, "device": accelerator.device,
        "distributed_type": distributed_type, "fork_launched": False,
        "local_process_index": accelerator.local_rank, "num_processes": accelerator.world_size,
        "process_index": accelerator.rank, _SHARED_MARK: True,
    }
    if not own_partial:
        partial.clear()
        partial.update(facts)
    full.clear()
    full.update(facts, fsdp_plugin=accelerator.state.fsdp_plugin, deepspeed_plugin=accelerator.state.deepspeed_plugin,
                deepspeed_plugins=None, megatron_lm_plugin=None, dynamo_plugin=accelerator.state.dynamo_plugin,
                torch_tp_plugin=None, parallelism_config=None, device_mesh=None)
    return True


def unshare_with_accelerate() -> None:
    """Empty Accelerate's state objects again if ``share_with_accelerate`` filled them (the job ended)."""
    module = sys.modules.get("accelerate.state")
    for name in ("AcceleratorState", "PartialState"):
        shared = getattr(getattr(module, name, None), "_shared_state", None)
        if isinstance(shared, dict) and shared.get(_SHARED_MARK):
            shared.clear()
