"""Read FSDP settings: an accelerate config yaml and the HF Trainer's ``--fsdp`` + ``fsdp_config``.

Both spell the same FSDP options, with or without the ``fsdp_`` prefix, FSDP1 or FSDP2 style:

- sharding: ``sharding_strategy`` FULL_SHARD / SHARD_GRAD_OP / NO_SHARD -> stage 3 / 2 / 0 (in
  accelerate's yaml also 1 / 2 / 3, its 1-based menu numbers); HYBRID_SHARD (4) / _HYBRID_SHARD_ZERO2
  (5) -> stage 3 / 2 with ``shard_group_size: node`` (sharded within each node, replicated across
  nodes); FSDP2's ``reshard_after_forward`` true -> 3, false -> 2, an int k -> 3 with
  ``reshard_after_forward: k`` (backward all-gathers within groups of k ranks).
- ``offload_params`` / ``cpu_offload`` -> offload_params and offload_optimizer (FSDP's CPUOffload
  keeps parameters and gradients on the host, so the optimizer steps there too).
- ``auto_wrap_policy`` TRANSFORMER_BASED_WRAP / SIZE_BASED_WRAP / NO_WRAP -> transformer / size /
  none; ``transformer_layer_cls_to_wrap`` (list or comma-separated), ``min_num_params``,
  ``backward_prefetch`` BACKWARD_PRE / BACKWARD_POST / NO_PREFETCH, ``forward_prefetch``,
  ``state_dict_type`` FULL / LOCAL / SHARDED_STATE_DICT, ``sync_module_states``,
  ``activation_checkpointing`` (and the HF Trainer's ``xla_fsdp_grad_ckpt``), ``cpu_ram_efficient_loading``
  (true turns ``sync_module_states`` on, as Accelerate does: rank 0's weights are broadcast).
- HF Trainer only: ``xla: true`` -> backend xla; ``xla_fsdp_settings.compute_dtype`` ->
  mixed_precision, ``.reshard_after_forward`` -> stage, ``.fp32_reduce_scatter`` -> reduce_dtype fp32.

xshard always keeps the user's parameter objects (``use_orig_params: true``) and bounds the
all-gathers in flight (``limit_all_gathers: true``); those values pass silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from xshard.config.precision_names import parse_dtype, parse_mixed_precision
from xshard.config.values import (
    Reading,
    XShardConfigError,
    fail,
    harmless,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    parse_names,
    parse_reshard,
    parse_stage,
    read_strategy,
)
from xshard.sharding.options import BACKWARD_PREFETCH_NAMES

WRAP = {"transformer_based_wrap": "transformer", "transformer": "transformer", "size_based_wrap": "size",
        "size": "size", "no_wrap": "none", "none": "none"}
STATE_DICT = {"full_state_dict": "full", "full": "full", "local_state_dict": "local", "local": "local",
              "sharded_state_dict": "sharded", "sharded": "sharded"}
# accelerate's yaml stores its menu choices as 1-based numbers
_MENU: dict[str, dict[int, Any]] = {
    "sharding_strategy": {1: 3, 2: 2, 3: 0},
    "backward_prefetch": {1: "pre", 2: "post", 3: "none"},
    "state_dict_type": {1: "full", 2: "local", 3: "sharded"},
}
# other spellings of the same option (FSDP1 / FSDP2 / HF Trainer / accelerate versions)
_SYNONYMS = {"backward_prefetch_policy": "backward_prefetch", "cpu_offload": "offload_params",
             "transformer_cls_names_to_wrap": "transformer_layer_cls_to_wrap",
             "xla_fsdp_grad_ckpt": "activation_checkpointing"}
_HARMLESS = {"use_orig_params": (True,), "limit_all_gathers": (True,), "version": (1, 2),
             "xla": (False,), "xla_fsdp_v2": (False,),
             "ignored_modules": (None,)}
_HARMLESS_XLA = {"flatten_parameters": (True, False), "shard_param_on_dim_0": (True,)}


def _menu(key: str, value: Any, where: str, numeric: bool) -> Any:
    """Translate accelerate's 1-based menu number for ``key``; other values pass through."""
    if not numeric or isinstance(value, bool) or not isinstance(value, (int, str)):
        return value
    try:
        number = int(str(value).strip())
    except ValueError:
        return value
    if key == "sharding_strategy" and number in (4, 5):
        return "hybrid_shard" if number == 4 else "_hybrid_shard_zero2"
    if number not in _MENU[key]:
        menu = ", ".join(f"{n} ({v})" for n, v in _MENU[key].items())
        raise fail(where, value, f"accelerate's menu number {menu}, or a name")
    return _MENU[key][number]


def _reshard(reading: Reading, where: str, value: Any) -> None:
    """FSDP2's reshard_after_forward: true -> stage 3, false -> 2, an int -> 3 resharding to that group
    size; FSDP1 style, a strategy name."""
    if isinstance(value, str) and value.strip().lower() not in ("true", "false") and not value.strip().isdigit():
        read_strategy(reading, where, value)
        return
    if isinstance(value, bool) or isinstance(value, str) and not value.strip().isdigit():
        reading.set("stage", 3 if parse_bool(where, value) else 2, where)
        return
    size = parse_reshard(where, value)
    reading.set("stage", 3, where)
    reading.set("reshard_after_forward", size, where)


def _either_turns_on(reading: Reading, field: str, value: bool, where: str) -> None:
    """Set a flag two keys may set: one key's "false" does not cancel the other's "true"."""
    if value or field not in reading.values:
        reading.values[field] = value
        reading.origin[field] = where


def _option(reading: Reading, key: str, value: Any, where: str, numeric: bool) -> bool:
    """Map one FSDP option (key without the fsdp_ prefix); False if xshard has no such option."""
    key = _SYNONYMS.get(key, key)
    if key in _MENU:
        value = _menu(key, value, where, numeric)
    if key == "sharding_strategy":
        read_strategy(reading, where, value)
    elif key == "reshard_after_forward":
        _reshard(reading, where, value)
    elif key == "offload_params":
        offload = parse_bool(where, value)
        reading.set("offload_params", offload, where)
        reading.set("offload_optimizer", offload, where)
    elif key == "auto_wrap_policy":
        reading.set("auto_wrap_policy", parse_choice(where, value, WRAP), where)
    elif key == "transformer_layer_cls_to_wrap":
        names = parse_names(where, value)
        if names:
            reading.set("transformer_layer_cls_to_wrap", names, where)
    elif key == "min_num_params":
        number = parse_int(where, value, 0)
        if number > 0:
            reading.set("min_num_params", number, where)
    elif key == "backward_prefetch":
        reading.set("backward_prefetch", parse_choice(where, value, BACKWARD_PREFETCH_NAMES), where)
    elif key == "forward_prefetch":
        reading.set("forward_prefetch", parse_bool(where, value), where)
    elif key == "state_dict_type":
        reading.set("state_dict_type", parse_choice(where, value, STATE_DICT), where)
    elif key == "sync_module_states":
        _either_turns_on(reading, "sync_module_states", parse_bool(where, value), where)
    elif key == "cpu_ram_efficient_loading":
        # Accelerate turns sync_module_states on with it (rank 0 loads, the others receive its weights);
        # transformers' rank-0-only loading is xshard.from_pretrained_sharded's
        if parse_bool(where, value):
            _either_turns_on(reading, "sync_module_states", True, where)
    elif key == "activation_checkpointing":
        # either spelling (or xla_fsdp_grad_ckpt) turns it on
        _either_turns_on(reading, "activation_checkpointing", parse_bool(where, value), where)
    else:
        return False
    return True


def read_fsdp_options(reading: Reading, options: Any, where: str, numeric: bool) -> None:
    """Map an FSDP options mapping (``fsdp_config``) onto ``reading``."""
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise fail(where, options, "a mapping of FSDP options")
    for raw_key, value in options.items():
        path = f"{where}.{raw_key}"
        if not isinstance(raw_key, str):
            raise fail(path, raw_key, "an option name (string)")
        key = raw_key[5:] if raw_key.startswith("fsdp_") else raw_key
        if _option(reading, key, value, path, numeric):
            continue
        if key == "xla":
            if parse_bool(path, value):
                reading.set("backend", "xla", path)
        elif key == "xla_fsdp_settings":
            _xla_settings(reading, value, path)
        elif not harmless(value, _HARMLESS.get(key, ())):
            reading.ignore(path)


def _xla_settings(reading: Reading, settings: Any, where: str) -> None:
    if not isinstance(settings, Mapping):
        raise fail(where, settings, "a mapping of XlaFullyShardedDataParallel arguments")
    for key, value in settings.items():
        path = f"{where}.{key}"
        if key == "compute_dtype":
            dtype = parse_dtype(path, value)
            reading.set("mixed_precision", "no" if dtype in (None, "fp32") else dtype, path)
        elif key == "reshard_after_forward":
            _reshard(reading, path, value)
        elif key == "fp32_reduce_scatter":
            if parse_bool(path, value):
                reading.set("reduce_dtype", "fp32", path)
        elif not harmless(value, _HARMLESS_XLA.get(key, ())):
            reading.ignore(path)


# ---------------------------------------------------------------- accelerate's config yaml

ACCELERATE_MARKERS = frozenset({"distributed_type", "compute_environment", "fsdp_config", "deepspeed_config",
                                "num_processes", "main_training_function"})
_DISTRIBUTED = ("FSDP", "DEEPSPEED", "NO", "MULTI_GPU", "MULTI_NPU", "MULTI_CPU", "MULTI_XPU", "MULTI_MLU",
                "MULTI_MUSA", "MULTI_HPU", "MULTI_SDAA", "XLA", "TPU")
# top-level values that change nothing (accelerate's defaults and launcher-only settings left empty)
_ACCELERATE_DEFAULTS = {"compute_environment": ("LOCAL_MACHINE",), "main_training_function": ("main",),
                        "rdzv_backend": ("static",), "same_network": (True,), "machine_rank": (0,),
                        "gpu_ids": ("all",), "downcast_bf16": ("no",), "dynamo_backend": ("NO", "no")}
#: launch settings: `xshard launch --config_file` reads them (xshard.cli.launch.accelerate_launch_keys)
ACCELERATE_LAUNCH_KEYS = frozenset({"machine_rank", "main_process_ip", "main_process_port", "gpu_ids"})
_DS_PLUGIN_HARMLESS = {"zero3_init_flag": (False,), "deepspeed_multinode_launcher": ("standard",)}


def _empty(value: Any) -> bool:
    return value is None or value is False or value == "" or (isinstance(value, (dict, list)) and not value)


def _accelerate_deepspeed(reading: Reading, section: Any, read_ds_file: Callable[[str, str], None]) -> None:
    where = "deepspeed_config"
    if not isinstance(section, Mapping):
        raise fail(where, section, "a mapping")
    for key, value in section.items():
        path = f"{where}.{key}"
        if key == "deepspeed_config_file":
            if not isinstance(value, str) or not value:
                raise fail(path, value, "the path of a ds_config.json")
            read_ds_file(value, path)
        elif key == "zero_stage":
            reading.set("stage", parse_stage(path, value), path)
        elif key in ("offload_optimizer_device", "offload_param_device"):
            device = parse_choice(path, "none" if value is None else value, {"cpu": "cpu", "none": "none"})
            field = "offload_optimizer" if key == "offload_optimizer_device" else "offload_params"
            reading.set(field, device == "cpu", path)
        elif key == "gradient_accumulation_steps":
            reading.set(key, parse_int(path, value, 1), path)
        elif key == "gradient_clipping":
            reading.set(key, parse_float(path, value, 0.0) or None, path)
        elif key == "zero3_save_16bit_model":
            reading.set("state_dict_type", "full" if parse_bool(path, value) else "sharded", path)
        elif not harmless(value, _DS_PLUGIN_HARMLESS.get(key, ())):
            reading.ignore(path)


def read_accelerate(data: Mapping[str, Any], reading: Reading,
                    read_ds_file: Callable[[str, str], None]) -> Reading:
    """Map an accelerate config (``accelerate config`` output) onto ``reading``."""
    kind = data.get("distributed_type", "NO")
    kind = parse_choice("distributed_type", kind, {k.lower(): k for k in _DISTRIBUTED})
    if kind not in ("FSDP", "DEEPSPEED"):
        reading.set("stage", 0, "distributed_type")  # plain data parallel
    machines = parse_int("num_machines", data.get("num_machines", 1), 1)
    reading.set("num_nodes", machines, "num_machines")
    for key, value in data.items():
        if key == "fsdp_config" and kind == "FSDP":
            read_fsdp_options(reading, value, key, numeric=True)
        elif key == "deepspeed_config" and kind == "DEEPSPEED":
            _accelerate_deepspeed(reading, value, read_ds_file)
        elif key == "mixed_precision":
            reading.set("mixed_precision", parse_mixed_precision(key, value), key)
        elif key == "num_processes":
            processes = parse_int(key, value, 1)
            if processes % machines:
                raise XShardConfigError(
                    f"num_processes={processes} is not a multiple of num_machines={machines}; "
                    "xshard starts the same number of processes on every node", ("devices",))
            reading.set("devices", processes // machines, key)
        elif key == "use_cpu":
            if parse_bool(key, value):
                reading.set("backend", "cpu", key)
        elif key in ("distributed_type", "num_machines") or key in ACCELERATE_LAUNCH_KEYS:
            continue
        elif not (_empty(value) or harmless(value, _ACCELERATE_DEFAULTS.get(key, ()))):
            reading.ignore(key)
    if kind == "FSDP" and "stage" not in reading.values:
        reading.set("stage", 3, "distributed_type")  # FSDP's default strategy: FULL_SHARD
    if kind == "DEEPSPEED" and "stage" not in reading.values:
        reading.set("stage", 2, "distributed_type")  # accelerate's DeepSpeed plugin default: ZeRO-2
    return reading


# ---------------------------------------------------------------- the HF Trainer's --fsdp

_HF_STAGES = {"full_shard": 3, "shard_grad_op": 2, "no_shard": 0}
_HF_OPTIONS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload",
               "auto_wrap")


def hf_fsdp_items(fsdp: Any) -> list[str]:
    """The words of ``--fsdp`` ("full_shard auto_wrap offload"), from a string, a list or True."""
    if fsdp is True:
        return ["full_shard"]
    if isinstance(fsdp, str):
        return fsdp.split()
    if isinstance(fsdp, (list, tuple)) and all(isinstance(s, str) for s in fsdp):
        return [s.strip() for s in fsdp if s.strip()]
    raise fail("fsdp", fsdp, f"a string of words among {', '.join(_HF_OPTIONS)} (e.g. 'full_shard auto_wrap')")


def read_hf_fsdp(fsdp: Any, fsdp_config: Mapping[str, Any] | None, reading: Reading) -> Reading:
    """Map the HF Trainer's ``--fsdp`` words and its ``fsdp_config`` onto ``reading``."""
    words = [w.lower() for w in hf_fsdp_items(fsdp)]
    wrap = False
    for word in words:
        if word in _HF_STAGES:
            reading.set("stage", _HF_STAGES[word], f"fsdp '{word}'")
        elif word == "offload":
            reading.set("offload_params", True, "fsdp 'offload'")
            reading.set("offload_optimizer", True, "fsdp 'offload'")
        elif word == "auto_wrap":
            wrap = True
        elif word in ("hybrid_shard", "hybrid_shard_zero2"):
            read_strategy(reading, f"fsdp '{word}'", word)
        else:
            raise fail("fsdp", word, f"words among {', '.join(_HF_OPTIONS)}")
    read_fsdp_options(reading, fsdp_config, "fsdp_config", numeric=False)
    if "stage" not in reading.values:
        reading.set("stage", 3, "fsdp")
    if "auto_wrap_policy" not in reading.values:
        # the Trainer's rule: size-based when min_num_params > 0, else by class name when wrapping
        if "min_num_params" in reading.values:
            reading.set("auto_wrap_policy", "size", "fsdp_config.min_num_params")
        elif wrap or "transformer_layer_cls_to_wrap" in reading.values:
            reading.set("auto_wrap_policy", "transformer", "fsdp 'auto_wrap'")
        else:
            reading.set("auto_wrap_policy", "none", "fsdp (no 'auto_wrap')")
    return reading
