"""Accelerate's constructor arguments, read for ``xshard.Accelerator``.

``read_accelerate_args(kwargs)`` takes Accelerate's keyword arguments out of the Accelerator's
``**kwargs`` (what is left are xshard config fields) and says what each one means here:

- config fields: ``mixed_precision`` (and the old ``fp16=True``), ``gradient_accumulation_steps`` /
  ``gradient_accumulation_plugin.num_steps``, ``fsdp_plugin`` and ``deepspeed_plugin`` fields, the
  bucket size of ``DistributedDataParallelKwargs``;
- job settings: ``cpu`` (the cpu backend), ``split_batches`` / ``dataloader_config``,
  ``step_scheduler_with_optimizer``, the accumulation plugin's flags, ``log_with``,
  ``project_dir`` / ``project_config``, the timeout of ``InitProcessGroupKwargs``,
  ``GradScalerKwargs``, ``AutocastKwargs(enabled=...)``, ``ProfileKwargs`` (``accelerator.profile()``);
- ``dynamo_backend`` / ``dynamo_plugin``: how ``prepare`` compiles each model (``xshard.config.dynamo``);
- everything with no meaning in xshard (``megatron_lm_plugin``,
  ``even_batches=False`` ...) is listed in ``ignored`` and named in ONE warning by the Accelerator.
  A plugin's field is named only when set away from its default (``accelerate_fields`` lists the fields
  xshard does not act on, and why);
- ``DistributedDataParallelKwargs(comm_hook=FP16 / BF16)``: stage 0's all-reduce dtype, settled with the
  config's stage by ``settle_with_config`` once the config is read (named in the warning at stages 1-3).

Accelerate's own objects (``accelerate.utils.ProjectConfiguration`` ...) and xshard's classes of the
same names (``xshard.utils``) are both accepted: their fields are read by name.

Whether the job's config came from DeepSpeed (a ds_config, an accelerate yaml with
``distributed_type: DEEPSPEED``, the ``hf_ds_config`` of a ``DeepSpeedPlugin``) is the config reader's
record (``xshard.config.read_source``), which ``accelerator.state`` asks.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .accelerate_fields import POLICY_FUNCTION, ignored_class_note, ignored_field_notes, shown
from .dynamo import TorchDynamoPlugin, read_dynamo_args
from .precision_names import MIXED_PRECISION, parse_dtype
from .values import (
    Reading,
    XShardConfigWarning,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    parse_stage,
)

if TYPE_CHECKING:
    from .schema import XShardConfig

#: Accelerate's constructor arguments (taken out of ``**kwargs``; the rest are xshard config fields)
ACCELERATE_ARGS = (
    "device_placement", "split_batches", "mixed_precision", "gradient_accumulation_steps", "cpu",
    "dataloader_config", "deepspeed_plugin", "fsdp_plugin", "torch_tp_plugin", "megatron_lm_plugin",
    "rng_types", "log_with", "project_dir", "project_config", "gradient_accumulation_plugin",
    "step_scheduler_with_optimizer", "kwargs_handlers", "dynamo_backend", "dynamo_plugin", "deepspeed_plugins",
    "parallelism_config", "fp16",
)
_NOTHING = (None, False)


@dataclass
class AccelerateSettings:
    """What Accelerate's arguments ask of an xshard job."""

    overrides: dict[str, Any] = field(default_factory=dict)  # xshard config fields
    backend: str | None = None
    timeout: datetime.timedelta | None = None
    split_batches: bool = False
    data_seed: int | None = None
    #: Accelerate's ``use_seedable_sampler``: a plain shuffle's order from one seed and the epoch
    #: (``xshard.runtime.batch_order``); the Trainer's choice, not Accelerate's default
    use_seedable_sampler: bool = False
    non_blocking: bool | None = None
    step_scheduler_with_optimizer: bool = True
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    log_with: list[Any] = field(default_factory=list)
    project: Any = None
    scaler_kwargs: dict[str, Any] = field(default_factory=dict)
    autocast_enabled: bool = True
    #: a ``ProfileKwargs`` (xshard's or Accelerate's): what ``accelerator.profile()`` records by default
    profile_handler: Any = None
    #: a ds_config (path, dict) from ``deepspeed_plugin.hf_ds_config``: the config when none is given
    ds_config: Any = None
    #: values for the ds_config's ``"auto"`` entries, in the HF Trainer's argument names
    script_args: dict[str, Any] = field(default_factory=dict)
    #: ``DistributedDataParallelKwargs.comm_hook`` "fp16" / "bf16": stage 0's all-reduce dtype
    #: (``settle_with_config``)
    comm_hook: str | None = None
    ignored: list[str] = field(default_factory=list)
    #: ``dynamo_backend`` / ``dynamo_plugin``: how prepared models are compiled (``xshard.config.dynamo``)
    dynamo: TorchDynamoPlugin | None = None


def _name(value: Any) -> Any:
    """torch and Accelerate enums by their name; everything else as it is."""
    return value.name if isinstance(value, Enum) else value


def _kind(obj: Any) -> str:
    return type(obj).__name__


def read_accelerate_args(kwargs: dict[str, Any]) -> AccelerateSettings:
    """Pop Accelerate's arguments from ``kwargs`` and read them (see the module docstring)."""
    args = {name: kwargs.pop(name) for name in ACCELERATE_ARGS if name in kwargs}
    out = AccelerateSettings()
    ignored = out.ignored

    precision = args.get("mixed_precision")
    if args.get("fp16"):
        precision = precision or "fp16"
    if precision is not None:
        out.overrides["mixed_precision"] = _name(precision)
    accumulation = args.get("gradient_accumulation_steps")
    plugin = args.get("gradient_accumulation_plugin")
    if plugin is not None:
        if accumulation not in (None, 1):
            raise ValueError("pass one of gradient_accumulation_steps and gradient_accumulation_plugin, not both")
        accumulation = getattr(plugin, "num_steps", None)
        out.adjust_scheduler = bool(getattr(plugin, "adjust_scheduler", True))
        out.sync_with_dataloader = bool(getattr(plugin, "sync_with_dataloader", True))
        out.sync_each_batch = bool(getattr(plugin, "sync_each_batch", False))
    if accumulation is not None:
        out.overrides["gradient_accumulation_steps"] = parse_int("gradient_accumulation_steps", accumulation, 1)
    out.script_args["gradient_accumulation_steps"] = out.overrides.get("gradient_accumulation_steps", 1)
    if args.get("cpu"):
        out.backend = "cpu"
    out.step_scheduler_with_optimizer = bool(args.get("step_scheduler_with_optimizer", True))
    out.split_batches = bool(args.get("split_batches", False))
    _dataloader_config(args.get("dataloader_config"), out)
    if args.get("device_placement", True) is False:
        ignored.append("device_placement=False (prepared loaders always place batches on the device)")
    rng = args.get("rng_types")
    if rng is not None and [str(_name(r)).lower() for r in rng] != ["generator"]:
        ignored.append(f"rng_types={rng!r} (every rank's shuffle comes from one seed; no RNG is synchronised)")
    log_with = args.get("log_with")
    if log_with is not None:
        out.log_with = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    out.project = _project(args.get("project_config"), args.get("project_dir"), ignored)
    seen: set[str] = set()
    for handler in args.get("kwargs_handlers") or ():
        if _kind(handler) in seen:
            raise ValueError(f"kwargs_handlers holds two {_kind(handler)} objects: pass one (Accelerate refuses "
                             "two as well)")
        seen.add(_kind(handler))
        _handler(handler, out)
    _fsdp_plugin(args.get("fsdp_plugin"), out)
    _deepspeed_plugin(args.get("deepspeed_plugin"), out)
    out.dynamo = read_dynamo_args(args.get("dynamo_backend"), args.get("dynamo_plugin"))
    for name in ("torch_tp_plugin", "megatron_lm_plugin", "parallelism_config", "deepspeed_plugins"):
        plugin = args.get(name)
        if plugin is not None:
            note = ignored_class_note(plugin)
            ignored.append(f"{name}={note}" if note else f"{name} (xshard shards data-parallel only)")
    return out


#: what a user of ``accelerate.local_sgd.LocalSGD`` needs at stages 1-3 (Accelerate refuses it under FSDP)
LOCAL_SGD_NEEDS_STAGE_0 = (
    "accelerate.local_sgd.LocalSGD runs only on plain data parallel: Accelerate refuses it under FSDP and "
    "DeepSpeed, and this job runs at ZeRO stage {stage} (distributed_type {kind}). Run the script at stage 0: "
    "stage: 0 in the config, XSHARD_STAGE=0, or FullyShardedDataParallelPlugin(sharding_strategy='NO_SHARD')"
)


def settle_with_config(settings: AccelerateSettings, config: XShardConfig) -> XShardConfig:
    """What depends on the config's stage: a DDP ``comm_hook``, and a script that imported Accelerate's LocalSGD.

    At stage 0 ``comm_hook`` FP16 / BF16 becomes the all-reduce dtype (``reduce_dtype``); at stages 1-3 it
    is named in the one warning. A script that imported ``accelerate.local_sgd`` is told, at stages 1-3, to
    run at stage 0 (LocalSGD's own error names CPUs and GPUs only). Returns the config (a new one when
    ``reduce_dtype`` was set)."""
    hook = settings.comm_hook
    if hook is not None:
        note = f"DistributedDataParallelKwargs(comm_hook={hook!r})"
        if config.stage != 0:
            settings.ignored.append(f"{note}: stages 1-3 reduce-scatter in the gradients' dtype (set reduce_dtype "
                                    f"to choose another); this job runs at stage {config.stage}")
        elif config.reduce_dtype is None:
            config = dataclasses.replace(config, reduce_dtype=hook)
        elif config.reduce_dtype != hook:
            settings.ignored.append(f"{note}: the config's reduce_dtype={config.reduce_dtype!r} is used")
    if config.stage != 0 and "accelerate.local_sgd" in sys.modules and os.environ.get("RANK", "0") == "0":
        kind = "DEEPSPEED" if settings.ds_config is not None else "FSDP"
        warnings.warn(LOCAL_SGD_NEEDS_STAGE_0.format(stage=config.stage, kind=kind), XShardConfigWarning,
                      stacklevel=4)
    return config


def _dataloader_config(config: Any, out: AccelerateSettings) -> None:
    if config is None:
        return
    out.split_batches = out.split_batches or bool(getattr(config, "split_batches", False))
    out.ignored.extend(ignored_field_notes(config, "DataLoaderConfiguration"))
    out.use_seedable_sampler = bool(getattr(config, "use_seedable_sampler", False))
    seed = getattr(config, "data_seed", None)
    if seed is not None:
        out.data_seed = parse_int("dataloader_config.data_seed", seed, 0)
        if not out.use_seedable_sampler:  # Accelerate reads it only for its seedable sampler
            out.ignored.append(f"dataloader_config.data_seed={seed} without use_seedable_sampler=True (as in "
                               "Accelerate, a plain shuffle then draws its order from torch's RNG; pass "
                               "use_seedable_sampler=True to shuffle from this seed)")
    if getattr(config, "non_blocking", False):
        out.non_blocking = True


def _project(config: Any, project_dir: Any, ignored: list[str]) -> Any:
    from .project_configuration import ProjectConfiguration

    project = config if config is not None else ProjectConfiguration(project_dir=None)
    if project_dir is not None and getattr(project, "project_dir", None) is None:
        project.set_directories(os.fspath(project_dir))
    ignored.extend(ignored_field_notes(project, "ProjectConfiguration"))
    return project


#: DistributedDataParallelKwargs.comm_hook's values (DDPCommunicationHookType, any case)
_COMM_HOOKS = {name: name for name in ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")}


def _comm_hook(handler: Any, out: AccelerateSettings) -> None:
    """DDP's comm_hook: FP16 / BF16 are stage 0's all-reduce dtype; PowerSGD is named in the warning."""
    value = getattr(handler, "comm_hook", "no")
    hook = parse_choice("DistributedDataParallelKwargs.comm_hook", str(_name(value)).lower(), _COMM_HOOKS)
    if hook in ("fp16", "bf16"):
        out.comm_hook = hook
    elif hook != "no":
        out.ignored.append(f"DistributedDataParallelKwargs(comm_hook={shown(value)}): PowerSGD is not run, "
                           "xshard all-reduces uncompressed")


def _handler(handler: Any, out: AccelerateSettings) -> None:
    kind = _kind(handler)
    out.ignored.extend(ignored_field_notes(handler))  # the fields xshard does not act on (accelerate_fields)
    if kind == "InitProcessGroupKwargs":
        timeout = getattr(handler, "timeout", None)
        if timeout is not None:
            out.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    elif kind == "GradScalerKwargs":
        for name, default in (("init_scale", 65536.0), ("growth_factor", 2.0), ("backoff_factor", 0.5),
                              ("growth_interval", 2000), ("enabled", True)):
            value = getattr(handler, name, default)
            if value != default:
                out.scaler_kwargs[name] = value
    elif kind == "DistributedDataParallelKwargs":
        bucket = getattr(handler, "bucket_cap_mb", 25)
        if bucket != 25:
            out.overrides["bucket_size_mb"] = parse_float("DistributedDataParallelKwargs.bucket_cap_mb", bucket, 0.0)
        # find_unused_parameters, static_graph, gradient_as_bucket_view, check_reduction: what xshard's stage 0
        # does anyway (any graph, gradients as views of the buckets; torch ignores check_reduction)
        _comm_hook(handler, out)
    elif kind == "ProfileKwargs":
        out.profile_handler = handler
    elif kind == "AutocastKwargs":
        out.autocast_enabled = bool(getattr(handler, "enabled", True))
    else:
        out.ignored.append(ignored_class_note(handler) or f"kwargs_handlers {kind} (no xshard equivalent)")


# FullyShardedDataParallelPlugin fields that xshard's FSDP option reader takes by the same names. fsdp_version
# and use_orig_params need nothing (xshard's one core keeps the user's parameters); the fields it does not act
# on are accelerate_fields'.
_FSDP_FIELDS = ("sharding_strategy", "reshard_after_forward", "backward_prefetch", "state_dict_type",
                "sync_module_states", "forward_prefetch", "activation_checkpointing", "transformer_cls_names_to_wrap",
                "min_num_params", "cpu_ram_efficient_loading")
_FSDP = "FullyShardedDataParallelPlugin"
#: torch's wrap-policy functions (what Accelerate's plugin turns its policy names into) -> the names
_POLICY_FUNCTIONS = {"transformer_auto_wrap_policy": "transformer_based_wrap",
                     "size_based_auto_wrap_policy": "size_based_wrap"}


def _wrap_policy(plugin: Any, options: dict[str, Any], out: AccelerateSettings) -> None:
    """``auto_wrap_policy``: a name, torch's transformer / size policy (or a partial of one); another
    function is named in the warning (units follow transformer_cls_names_to_wrap / _no_split_modules)."""
    policy = getattr(plugin, "auto_wrap_policy", None)
    if policy is None:
        return
    if not callable(policy):
        options["auto_wrap_policy"] = policy
        return
    function, keywords = getattr(policy, "func", policy), getattr(policy, "keywords", None) or {}
    name = _POLICY_FUNCTIONS.get(getattr(function, "__name__", ""))
    if name is None:
        out.ignored.append(f"{_FSDP}(auto_wrap_policy={shown(policy)}): {POLICY_FUNCTION}")
        return
    options["auto_wrap_policy"] = name
    layers = keywords.get("transformer_layer_cls")
    if layers and "transformer_cls_names_to_wrap" not in options:
        options["transformer_cls_names_to_wrap"] = [getattr(c, "__name__", str(c)) for c in layers]
    if keywords.get("min_num_params") and "min_num_params" not in options:
        options["min_num_params"] = keywords["min_num_params"]


def _offloads(offload: Any) -> bool:
    """``cpu_offload``: a bool, FSDP1's ``CPUOffload(offload_params=)``, or FSDP2's policy (``CPUOffloadPolicy``
    offloads, the plain ``OffloadPolicy`` Accelerate's FSDP2 plugin fills in does not)."""
    if isinstance(offload, bool):
        return offload
    if hasattr(offload, "offload_params"):
        return bool(offload.offload_params)
    return any(cls.__name__ == "CPUOffloadPolicy" for cls in type(offload).__mro__)


def _mixed_precision_policy(policy: Any, out: AccelerateSettings) -> None:
    """FSDP's MixedPrecision (an object, a dict or a name): param_dtype -> mixed_precision, reduce_dtype ->
    reduce_dtype; a buffer_dtype other than param_dtype is named in the warning (buffers follow param_dtype)."""
    if policy is None:
        return
    if isinstance(policy, str):
        policy = {"param_dtype": policy}
    values = policy if isinstance(policy, Mapping) else vars(policy)
    param, reduce, buffer = (values.get(name) for name in ("param_dtype", "reduce_dtype", "buffer_dtype"))
    if str(param).lower() in MIXED_PRECISION:
        out.overrides.setdefault("mixed_precision", MIXED_PRECISION[str(param).lower()])
    if reduce is not None:
        where = f"{_FSDP}.mixed_precision_policy.reduce_dtype"
        out.overrides.setdefault("reduce_dtype", parse_dtype(where, str(reduce)))
    if buffer is not None and str(buffer) != str(param):
        out.ignored.append(f"{_FSDP}(mixed_precision_policy=...): buffer_dtype={buffer} (buffers follow param_dtype)")


def _fsdp_plugin(plugin: Any, out: AccelerateSettings) -> None:
    """Map a FullyShardedDataParallelPlugin's fields onto config fields (as the accelerate yaml's)."""
    if plugin is None:
        return
    from .fsdp import read_fsdp_options

    options: dict[str, Any] = {}
    for name in _FSDP_FIELDS:
        value = _name(getattr(plugin, name, None))
        if value is not None:
            options[name] = value
    _wrap_policy(plugin, options, out)
    out.ignored.extend(ignored_field_notes(plugin, _FSDP))
    offload = getattr(plugin, "cpu_offload", None)
    if offload is not None:
        options["offload_params"] = _offloads(offload)
    reading = Reading("fsdp_plugin")
    read_fsdp_options(reading, options, "fsdp_plugin", numeric=True)
    out.overrides.update(reading.values)
    out.ignored.extend(reading.ignored)
    _mixed_precision_policy(getattr(plugin, "mixed_precision_policy", None), out)
    if "stage" not in out.overrides:
        out.overrides["stage"] = 3  # FSDP's default strategy: FULL_SHARD


def _deepspeed_plugin(plugin: Any, out: AccelerateSettings) -> None:
    """A DeepSpeedPlugin: its ds_config is the config; its own fields fill "auto" or override."""
    if plugin is None:
        return
    out.ignored.extend(ignored_field_notes(plugin, "DeepSpeedPlugin"))
    ds = getattr(plugin, "hf_ds_config", None)
    ds = getattr(ds, "config", ds)  # Accelerate wraps the dict in an HfDeepSpeedConfig
    if ds is not None and ds != "none":
        out.ds_config = ds
    where = "deepspeed_plugin"
    stage = getattr(plugin, "zero_stage", None)
    if stage is not None and out.ds_config is None:
        out.overrides["stage"] = parse_stage(f"{where}.zero_stage", stage)
    for name, field_ in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
        device = getattr(plugin, name, None)
        if device is not None and out.ds_config is None:
            device = parse_choice(f"{where}.{name}", str(device), {"cpu": "cpu", "none": "none"})
            out.overrides[field_] = device == "cpu"
    steps = getattr(plugin, "gradient_accumulation_steps", None)
    if isinstance(steps, int) and not isinstance(steps, bool):
        out.overrides.setdefault("gradient_accumulation_steps", parse_int(f"{where}.gradient_accumulation_steps",
                                                                           steps, 1))
        out.script_args["gradient_accumulation_steps"] = out.overrides["gradient_accumulation_steps"]
    clip = getattr(plugin, "gradient_clipping", None)
    if isinstance(clip, (int, float)) and not isinstance(clip, bool):
        out.script_args["max_grad_norm"] = float(clip)
        if out.ds_config is None:
            out.overrides["gradient_clipping"] = float(clip) or None
    save16 = getattr(plugin, "zero3_save_16bit_model", None)
    if save16 is not None and out.ds_config is None:
        out.overrides["state_dict_type"] = "full" if parse_bool(f"{where}.zero3_save_16bit_model", save16) else "sharded"
