"""Accelerate's names that xshard does not have, each with xshard's way to do the same where one exists.

A script moved from Accelerate that reaches one of them gets an ``AttributeError`` naming the member
and the way, instead of a bare "no attribute" (``Accelerator.__getattr__``, ``xshard.__getattr__``).
Imports nothing (``import xshard`` stays light).
"""

from __future__ import annotations

# the names are xshard.config.precision_names's MIXED_PRECISION_NAMES (not imported: this module imports nothing)
_FP8 = "fp8 is not supported: mixed_precision is 'no', 'bf16' or 'fp16'"
_PARALLELISM = "xshard has data parallelism (sharded or not) only: the data-parallel rank is accelerator.process_index"

#: members of Accelerate's ``Accelerator`` -> xshard's way ("" where there is none)
ACCELERATOR_MEMBERS: dict[str, str] = {
    "register_save_state_pre_hook": "register_for_checkpointing(obj) saves any object with state_dict()/"
                                    "load_state_dict() in save_state",
    "register_load_state_pre_hook": "register_for_checkpointing(obj) restores any object with state_dict()/"
                                    "load_state_dict() in load_state",
    "verify_device_map": "xshard places the whole model itself (prepare); it takes no device_map",
    "lomo_backward": "use accelerator.backward(loss) with a torch optimizer",
    "has_lomo_optimizer": "use accelerator.backward(loss) with a torch optimizer",
    "deepspeed_engine_wrapped": "xshard runs no DeepSpeed engine: the prepared model and optimizer are the engine",
    "deepspeed_ulysses_dl_adapter": "xshard has no sequence parallelism",
    "maybe_context_parallel": "xshard has no context parallelism",
    "fp8_backend": _FP8,
    "fp8_enabled": _FP8,
    "fp8_recipe_handler": _FP8,
    "te_recipe_handler": _FP8,
    "ao_recipe_handler": _FP8,
    "msamp_recipe_handler": _FP8,
    "has_fp8_handler": _FP8,
    "delayed_fp8_autocast": _FP8,
    "parallelism_config": _PARALLELISM,
    "torch_device_mesh": "xshard's sharding groups are internal; the config's shard_group_size sets hybrid sharding",
    "is_composable_parallelism_enabled": _PARALLELISM,
    "data_parallel_rank": _PARALLELISM,
    "data_parallel_shard_rank": _PARALLELISM,
    "tensor_parallel_rank": _PARALLELISM,
    "pipeline_parallel_rank": _PARALLELISM,
    "context_parallel_rank": _PARALLELISM,
    "should_save_model": "every process calls save_model / save_state; xshard decides who writes",
    "rng_types": "shuffles come from the Accelerator's seed on every rank (set_seed / seed=)",
    "flag_tensor": "use set_trigger() / check_trigger()",
    "ddp_handler": "pass DistributedDataParallelKwargs in kwargs_handlers (bucket_cap_mb is used)",
    "scaler_handler": "the fp16 grad scaler is accelerator.scaler",
    "init_handler": "the process group's timeout is the config's timeout (or InitProcessGroupKwargs.timeout)",
    "autocast_handler": "pass AutocastKwargs to accelerator.autocast(autocast_handler=...)",
}

#: Accelerate's top-level names (``from accelerate import X``) -> xshard's way
MODULE_NAMES: dict[str, str] = {
    "PartialState": "build the Accelerator first and read its process facts (accelerator.process_index, "
                    "num_processes, is_main_process, main_process_first(), split_between_processes())",
    "AcceleratorState": "read accelerator.state",
    "init_empty_weights": "build the model under `with accelerator.sharded_init():` (each rank keeps its shard)",
    "notebook_launcher": "start the processes with `xshard launch --nproc N script.py`",
    "debug_launcher": "start the processes with `xshard launch --nproc N script.py` (the cpu backend)",
    "find_executable_batch_size": "xshard has no batch-size search; `xshard estimate` gives the memory per rank",
    "load_checkpoint_and_dispatch": "load the weights with from_pretrained, then accelerator.prepare(model)",
    "dispatch_model": "accelerator.prepare(model) places and shards the model",
    "cpu_offload": "set offload_params / offload_optimizer in the config",
    "disk_offload": "set offload_params / offload_optimizer in the config (CPU offload; no disk offload)",
}


def missing_member(owner: str, name: str, ways: dict[str, str]) -> AttributeError:
    """The error for ``owner.name``: Accelerate's member, and xshard's way when there is one."""
    way = ways.get(name)
    if way is None:
        return AttributeError(f"{owner!r} object has no attribute {name!r}")
    return AttributeError(f"{owner}.{name} is Accelerate's; xshard does not have it: {way}")
