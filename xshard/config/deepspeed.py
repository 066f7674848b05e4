"""Read a DeepSpeed ``ds_config.json`` into `XShardConfig` fields.

What maps (everything else is reported once as having no effect):

- ``zero_optimization.stage`` -> stage; at stage 3, ``mics_shard_size`` (MiCS: shard within groups of
  that many ranks, replicate across them; -1 = off) -> shard_group_size, and ``zero_hpz_partition_size``
  (ZeRO++ hpZ: a secondary copy of the parameters sharded within a node for backward's all-gathers;
  1 = off) -> reshard_after_forward; ``offload_optimizer.device`` / ``offload_param.device``
  ("cpu" or "none") -> offload_optimizer / offload_params (legacy ``cpu_offload`` too);
  ``stage3_gather_16bit_weights_on_model_save`` -> state_dict_type full (true) or sharded (false);
  ``reduce_bucket_size`` (elements) -> bucket_size_mb at stage 0 (fp32 gradients, or the
  communication dtype).
- ``bf16.enabled`` / ``fp16.enabled`` -> mixed_precision; ``communication_data_type`` -> reduce_dtype.
- ``train_micro_batch_size_per_gpu``, ``train_batch_size``, ``gradient_accumulation_steps``,
  ``gradient_clipping`` (0 = off) -> the fields of the same name; the batch triple is checked
  against the world size when it is known (and a missing accumulation is derived, as DeepSpeed does).
- ``optimizer`` / ``scheduler`` -> stored as ``{"type": ..., "params": {...}}`` for the script.

Values that match what xshard always does are accepted silently: overlap_comm, contiguous_gradients,
reduce_scatter and allgather_partitions true (xshard overlaps and reduce-scatters one flat buffer
per unit), and "auto" on tuning knobs xshard does not have ("let the framework choose").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xshard.config.precision_names import DEEPSPEED_SECTIONS, parse_dtype
from xshard.config.values import (
    Reading,
    XShardConfigError,
    fail,
    harmless,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    parse_section,
    parse_stage,
)

#: top-level keys of a DeepSpeed config that xshard's own format has too (the same settings; DeepSpeed's
#: ``activation_checkpointing`` is a section, xshard's a boolean): they mark neither format
SHARED_KEYS = frozenset({"train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                         "gradient_clipping", "optimizer", "scheduler", "activation_checkpointing"})
#: top-level keys only a DeepSpeed config has: they mark a file as one (`xshard.config.source`)
MARKERS = frozenset({
    "zero_optimization", "bf16", "bfloat16", "fp16", "amp", "communication_data_type", "steps_per_print",
    "wall_clock_breakdown", "zero_allow_untested_optimizer", "prescale_gradients", "gradient_predivide_factor",
})

# values that request exactly what xshard does anyway (no warning)
_HARMLESS_TOP = {
    "wall_clock_breakdown": (False,), "zero_allow_untested_optimizer": (True, False), "prescale_gradients": (False,),
    "gradient_predivide_factor": (1, 1.0), "zero_force_ds_cpu_optimizer": (True, False),
}
_HARMLESS_ZERO = {
    "overlap_comm": (True,), "contiguous_gradients": (True,), "reduce_scatter": (True,),
    "allgather_partitions": (True,), "load_from_fp32_weights": (True,), "reduce_bucket_size": ("auto",),
    "allgather_bucket_size": ("auto",), "stage3_prefetch_bucket_size": ("auto",),
    "stage3_param_persistence_threshold": ("auto",), "round_robin_gradients": (False,),
    "mics_shard_size": (-1,), "zero_hpz_partition_size": (1,), "mics_hierarchical_params_gather": (False,),
}
_HARMLESS_OFFLOAD = {"pin_memory": (True, False)}
_HARMLESS_FP16 = {"loss_scale": (0,), "initial_scale_power": (16,), "auto_cast": (False,)}
# loss-scale knobs in a bf16 section do nothing in DeepSpeed either: no surprise to report
_BF16_SILENT = {"loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale",
                "consecutive_hysteresis"}
_OFFLOAD_DEVICES = {"cpu": "cpu", "none": "none", "nvme": "nvme"}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise fail(where, value, "a mapping of keys to values")
    return value


def _offload(reading: Reading, where: str, value: Any, field: str) -> None:
    if value is None:
        return
    for key, item in _mapping(where, value).items():
        path = f"{where}.{key}"
        if key == "device":
            device = "none" if item is None else parse_choice(path, item, _OFFLOAD_DEVICES)
            if device == "nvme":
                raise XShardConfigError(
                    f"{path}: 'nvme' offload is not supported by xshard; use 'cpu' or 'none'", (field,))
            reading.set(field, device == "cpu", path)
        elif not harmless(item, _HARMLESS_OFFLOAD.get(key, ())):
            reading.ignore(path)


def _zero(reading: Reading, where: str, value: Any) -> None:
    zero = _mapping(where, value)
    if "stage" in zero:
        reading.set("stage", parse_stage(f"{where}.stage", zero["stage"]), f"{where}.stage")
    stage = reading.values.get("stage", 0)
    for key, item in zero.items():
        path = f"{where}.{key}"
        if key == "stage":
            continue
        if key == "offload_optimizer":
            _offload(reading, path, item, "offload_optimizer")
        elif key == "offload_param":
            _offload(reading, path, item, "offload_params")
        elif key == "cpu_offload":
            reading.set("offload_optimizer", parse_bool(path, item), path)
        elif key in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
            reading.set("state_dict_type", "full" if parse_bool(path, item) else "sharded", path)
        elif key == "mics_shard_size" and _zero3(stage) and not harmless(item, (-1,)):
            reading.set("shard_group_size", parse_int(path, item, 1), path)
        elif key == "zero_hpz_partition_size" and _zero3(stage) and not harmless(item, (1,)):
            reading.set("reshard_after_forward", parse_int(path, item, 1), path)
        elif key == "reduce_bucket_size" and _replicates(stage) and not harmless(item, ("auto",)):
            elements = parse_int(path, item, 1)
            dtype = reading.values.get("reduce_dtype") or "fp32"
            reading.set("bucket_size_mb", elements * _DTYPE_BYTES[dtype] / 2**20, path)
        elif not harmless(item, _HARMLESS_ZERO.get(key, ())):
            reading.ignore(path)


def _precision(reading: Reading, key: str, value: Any) -> None:
    section = _mapping(key, value)
    enabled = parse_bool(f"{key}.enabled", section.get("enabled", False))
    name = DEEPSPEED_SECTIONS[key]
    if enabled:
        reading.set("mixed_precision", name, f"{key}.enabled")
    for sub, item in section.items():
        if sub == "enabled" or not enabled:
            continue
        if name == "bf16" and sub in _BF16_SILENT:
            continue
        if not harmless(item, _HARMLESS_FP16.get(sub, ()) if name == "fp16" else ()):
            reading.ignore(f"{key}.{sub}")


def _check_batch(reading: Reading, world: int | None) -> None:
    values = reading.values
    batch = values.get("train_batch_size")
    micro = values.get("train_micro_batch_size_per_gpu")
    accum = values.get("gradient_accumulation_steps")
    if world is None or batch is None or micro is None:
        return
    if accum is None:
        if batch % (micro * world):
            raise XShardConfigError(
                f"train_batch_size={batch} is not a multiple of train_micro_batch_size_per_gpu={micro} x "
                f"world size {world}; fix one of them",
                ("train_batch_size", "train_micro_batch_size_per_gpu"),
            )
        reading.set("gradient_accumulation_steps", batch // (micro * world), "train_batch_size")
    elif batch != micro * accum * world:
        raise XShardConfigError(
            f"train_batch_size={batch} != train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps="
            f"{accum} x world size {world} (= {micro * accum * world}); fix one of them or set it to 'auto'",
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
        )


def _zero3(stage: int) -> bool:
    """The stage frees the full parameters after forward (ZeRO-3, where DeepSpeed has MiCS and hpZ)."""
    from xshard.sharding.plan import ShardingPlan

    return ShardingPlan.for_stage(stage).reshard_after_forward.frees


def _replicates(stage: int) -> bool:
    """The stage keeps parameters whole and all-reduces gradients in buckets (their size matters)."""
    from xshard.sharding.plan import GradReduction, ShardingPlan

    return ShardingPlan.for_stage(stage).grad_reduction is GradReduction.ALL_REDUCE


def read_deepspeed(data: Mapping[str, Any], reading: Reading, world_size: int | None = None) -> Reading:
    """Map a DeepSpeed config (its "auto" values already resolved) onto ``reading``."""
    # communication dtype first: the stage-0 bucket size in MB depends on it
    if "communication_data_type" in data:
        reading.set("reduce_dtype", parse_dtype("communication_data_type", data["communication_data_type"]),
                    "communication_data_type")
    for key, value in data.items():
        if key == "zero_optimization":
            _zero(reading, key, value)
        elif key in DEEPSPEED_SECTIONS:
            _precision(reading, key, value)
        elif key in ("optimizer", "scheduler"):
            section = parse_section(key, value)
            reading.set(key, section, key)
            for extra in set(_mapping(key, value)) - {"type", "params"}:
                reading.ignore(f"{key}.{extra}")
        elif key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            reading.set(key, parse_int(key, value, 1), key)
        elif key == "train_batch_size":
            if value is not None:  # None: "auto" with the world size unknown, derived at run time
                reading.set(key, parse_int(key, value, 1), key)
        elif key == "gradient_clipping":
            clip = parse_float(key, value, 0.0)
            reading.set(key, clip or None, key)
        elif key == "communication_data_type":
            continue
        elif not harmless(value, _HARMLESS_TOP.get(key, ())):
            reading.ignore(key)
    if "stage" not in reading.values:
        reading.set("stage", 0, "zero_optimization.stage (absent: DeepSpeed's default)")
    _check_batch(reading, world_size)
    return reading
