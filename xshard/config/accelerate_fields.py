"""The fields of Accelerate's plugin and ``*Kwargs`` constructors that xshard does not act on, and why.

``accelerate_args`` honours the other fields (it maps them onto the config or the job). A field named here
is accepted and, when the user sets it away from its default, named in the Accelerator's one warning with
what xshard does instead. "Away from its default" is judged as Accelerate would fill the field itself: an
Accelerate object's ``__post_init__`` turns a default ``None`` into a value (``use_orig_params=False``, a
``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``), and those values are defaults too, never
warned (``is_default``).

Some classes xshard has no use for at all (fp8 recipes, Megatron-LM, tensor parallelism):
``IGNORED_CLASSES`` names them, and passing one is one warning naming the object and the fields set in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

_FP8 = "xshard does not train in fp8 (mixed_precision='fp8' is refused): use bf16"
_NOT_DATA_PARALLEL = "xshard shards data-parallel only (no tensor, pipeline or expert parallelism)"
#: an ``auto_wrap_policy`` function other than torch's transformer / size policies
POLICY_FUNCTION = ("a policy function is not called: units follow transformer_cls_names_to_wrap or the model's "
                   "_no_split_modules")

#: class name -> field -> what xshard does instead (named in the one warning when set away from its default)
IGNORED_FIELDS: dict[str, dict[str, str]] = {
    "FullyShardedDataParallelPlugin": {
        "ignored_modules": "xshard shards and reduces every module's parameters; freeze a parameter "
                           "(requires_grad=False) to keep it out of the gradient reduce",
        "state_dict_config": "get_state_dict and save_model give whole weights on the main process, and "
                             "state_dict_type picks full or sharded checkpoints",
        "optim_state_dict_config": "save_state writes each rank's optimizer shard in xshard's checkpoint format",
        "limit_all_gathers": "xshard always bounds the all-gathers in flight (max_inflight_all_gathers)",
        "param_init_fn": "xshard materializes meta-device parameters itself (the modules' reset_parameters, "
                         "or rank 0's weights broadcast)",
        "activation_checkpointing_offload": "checkpointed activations are recomputed in backward, not offloaded",
    },
    "DeepSpeedPlugin": {
        "is_train_batch_min": "a ds_config's \"auto\" micro-batch comes from the first prepared data loader",
        "offload_optimizer_nvme_path": "xshard offloads to host memory only (offload_optimizer_device='cpu')",
        "offload_param_nvme_path": "xshard offloads to host memory only (offload_param_device='cpu')",
        "zero3_init_flag": "build a large model with xshard.from_pretrained_sharded (each rank loads its own rows)",
        "transformer_moe_cls_names": _NOT_DATA_PARALLEL,
        "enable_msamp": _FP8,
        "msamp_opt_level": _FP8,
    },
    "DistributedDataParallelKwargs": {
        "dim": "each process holds one device, so DDP's scatter dimension has no meaning",
        "broadcast_buffers": "xshard broadcasts rank 0's buffers before each training forward, as DDP's default",
        "comm_wrapper": "the all-reduce runs in the comm_hook's dtype (FP16 / BF16) or the gradients' dtype",
        "comm_state_option": "PowerSGD is not run: xshard all-reduces uncompressed",
    },
    "InitProcessGroupKwargs": {
        "backend": "xshard's device layer picks the process group's backend (XSHARD_BACKEND)",
        "init_method": "xshard meets the other processes through torchrun's variables",
    },
    "AutocastKwargs": {
        "cache_enabled": "xshard's autocast keeps torch's default weight-cast cache",
    },
    "DataLoaderConfiguration": {
        "dispatch_batches": "every rank reads its own batches of the global order",
        "even_batches": "xshard evens the last batch by repeating samples, and gather_for_metrics drops the repeats",
    },
    "ProjectConfiguration": {
        "save_on_each_node": "xshard writes once per job: keep the project folder on a shared filesystem",
    },
}

#: classes xshard does nothing with where they are passed -> (why, whether one is named with every field at its
#: default)
IGNORED_CLASSES: dict[str, tuple[str, bool]] = {
    "FP8RecipeKwargs": (_FP8, True),
    "TERecipeKwargs": (_FP8, True),
    "MSAMPRecipeKwargs": (_FP8, True),
    "AORecipeKwargs": (_FP8, True),
    "MegatronLMPlugin": (_NOT_DATA_PARALLEL, True),
    "TorchTensorParallelPlugin": (_NOT_DATA_PARALLEL, True),
    # in kwargs_handlers (the Accelerator's dynamo_plugin argument is xshard.config.dynamo's)
    "TorchDynamoPlugin": ("pass it as Accelerator(dynamo_plugin=...), where Accelerate takes it too", True),
}


def _fsdp_state_dict_configs() -> list[Any]:
    """The state-dict configs Accelerate's FSDP plugin fills in for each state_dict_type."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    return [FullStateDictConfig(offload_to_cpu=True, rank0_only=True), ShardedStateDictConfig(offload_to_cpu=True),
            FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
            ShardedOptimStateDictConfig(offload_to_cpu=True)]


#: (class, field) -> values Accelerate fills in for a default that a fresh object of the class may not show
_FILLED_DEFAULTS: dict[tuple[str, str], Callable[[], list[Any]]] = {
    ("FullyShardedDataParallelPlugin", "state_dict_config"): _fsdp_state_dict_configs,
    ("FullyShardedDataParallelPlugin", "optim_state_dict_config"): _fsdp_state_dict_configs,
    ("DeepSpeedPlugin", "offload_optimizer_nvme_path"): lambda: ["none"],
    ("DeepSpeedPlugin", "offload_param_nvme_path"): lambda: ["none"],
    ("DeepSpeedPlugin", "zero3_init_flag"): lambda: [False],
    ("DeepSpeedPlugin", "enable_msamp"): lambda: [False],
    ("DeepSpeedPlugin", "msamp_opt_level"): lambda: ["O1"],
    ("DistributedDataParallelKwargs", "comm_state_option"): lambda: [{}],
    ("DataLoaderConfiguration", "dispatch_batches"): lambda: [False],
}


#: class -> a default-constructed object of it (``_fresh``)
_FRESH: dict[type, Any] = {}


def _fresh(cls: type) -> Any:
    """A default-constructed object of ``cls`` (what its ``__post_init__`` fills in), or None if it cannot be built."""
    if cls not in _FRESH:
        try:
            _FRESH[cls] = cls()
        except Exception:  # noqa: BLE001 (an Accelerate class that needs an absent package: no filled defaults)
            _FRESH[cls] = None
    return _FRESH[cls]


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (hasattr(a, "value") and hasattr(b, "value") and a.value == b.value)
    except Exception:  # noqa: BLE001 (values that cannot be compared, e.g. tensors: not equal)
        return False


def is_default(obj: Any, name: str) -> bool:
    """``obj.name`` holds its class's default, or the value the class fills in for that default itself."""
    value = getattr(obj, name, None)
    defaults: list[Any] = [None]
    for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                defaults.append(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                defaults.append(f.default_factory())
    fresh = _fresh(type(obj))
    if fresh is not None:
        defaults.append(getattr(fresh, name, None))
    filled = _FILLED_DEFAULTS.get((type(obj).__name__, name))
    if filled is not None:
        defaults.extend(filled())
    return any(_equal(value, d) for d in defaults)


def shown(value: Any) -> str:
    """A field's value as a warning shows it: short values as they are, long ones as ``...``."""
    text = repr(getattr(value, "value", value) if hasattr(value, "name") and hasattr(value, "value") else value)
    return text if len(text) <= 30 else "..."


def set_fields(obj: Any) -> list[str]:
    """The fields of ``obj`` (a dataclass) set away from their defaults, in declaration order."""
    if not dataclasses.is_dataclass(obj):
        return []
    return [f.name for f in dataclasses.fields(obj) if not is_default(obj, f.name)]


def ignored_field_notes(obj: Any, kind: str | None = None) -> list[str]:
    """One note per field of ``obj`` that xshard does not act on and the user set: ``Class(field=value): why``."""
    kind = kind or type(obj).__name__
    table = IGNORED_FIELDS.get(kind, {})
    return [f"{kind}({name}={shown(getattr(obj, name))}): {table[name]}"
            for name in table if hasattr(obj, name) and not is_default(obj, name)]


def ignored_class_note(obj: Any) -> str | None:
    """The note for an object of a class xshard does nothing with (``IGNORED_CLASSES``), or None."""
    kind = type(obj).__name__
    if kind not in IGNORED_CLASSES:
        return None
    why, always = IGNORED_CLASSES[kind]
    changed = set_fields(obj)
    if not changed and not always:
        return None
    return f"{kind}({', '.join(f'{n}={shown(getattr(obj, n))}' for n in changed)}): {why}"
