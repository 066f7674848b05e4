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
    "log_with": "the running trackers are accelerator.trackers (after init_trackers)",
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


def _names(ways: dict[str, str]) -> dict[str, str]:
    """``{"name other_name ...": way}`` -> one entry per name."""
    return {name: way for names, way in ways.items() for name in names.split()}


_ACCELERATE_HELPER = "a helper of Accelerate's own that needs no Accelerator: import it from accelerate.utils"
_OWN_LAUNCH = "start the job with `xshard launch` (its options); `xshard env` says the backend and device it picks"

#: ``accelerate.utils``' public names that ``xshard.utils`` has not -> xshard's way (``from xshard.utils import X``
#: raises an ImportError saying it: ``missing_name``)
UTILS_NAMES: dict[str, str] = _names({
    "broadcast broadcast_object_list gather gather_object reduce pad_across_processes wait_for_everyone "
    "copy_tensor_to_devices synchronize_rng_state synchronize_rng_states avg_losses_across_data_parallel_group":
        "use the Accelerator's method (accelerator.gather / reduce / pad_across_processes / wait_for_everyone; "
        "accelerator.gather_for_metrics(obj, use_gather_object=True) for objects)",
    "MODEL_NAME OPTIMIZER_NAME RNG_STATE_NAME SAFE_MODEL_NAME SAFE_WEIGHTS_INDEX_NAME SAFE_WEIGHTS_NAME "
    "SAFE_WEIGHTS_PATTERN_NAME SAMPLER_NAME SCALER_NAME SCHEDULER_NAME WEIGHTS_INDEX_NAME WEIGHTS_NAME "
    "WEIGHTS_PATTERN_NAME PROFILE_PATTERN_NAME":
        "xshard's checkpoints have their own layout (save_state / load_state); save_model writes model.safetensors",
    "AbstractTrainStep BertTrainStep GPTTrainStep T5TrainStep MegatronLMDummyDataLoader MegatronLMDummyScheduler "
    "MegatronLMPlugin add_model_config_to_megatron_parser": _PARALLELISM,
    "ParallelismConfig TorchContextParallelConfig TorchTensorParallelConfig TorchTensorParallelPlugin "
    "DeepSpeedSequenceParallelConfig get_model_tp_size": _PARALLELISM,
    "AORecipeKwargs FP8RecipeKwargs MSAMPRecipeKwargs TERecipeKwargs apply_fp8_autowrap check_cuda_fp8_capability "
    "contextual_fp8_autocast convert_model convert_model_to_fp8_ao filter_first_and_last_linear_layers "
    "has_ao_layers has_transformer_engine_layers torchao_required": _FP8,
    "GatheredParameters deepspeed_required prepare_deepspeed_cmd_env compile_regions_deepspeed":
        "xshard runs no DeepSpeed engine (a ds_config is read as xshard's config); "
        "accelerator.summon_full_params(model) gathers the parameters",
    "disable_fsdp_ram_efficient_loading enable_fsdp_ram_efficient_loading fsdp2_apply_ac fsdp2_canonicalize_names "
    "fsdp2_load_full_state_dict fsdp2_prepare_model fsdp2_switch_optimizer_parameters get_fsdp2_grad_scaler "
    "load_fsdp_model load_fsdp_optimizer save_fsdp_model save_fsdp_optimizer merge_fsdp_weights model_has_dtensor":
        "xshard shards the model itself (prepare); save_state / load_state keep model and optimizer, "
        "`xshard consolidate` merges a checkpoint's shards",
    "BnbQuantizationConfig OffloadedWeightsLoader PrefixedDataset align_module_device calculate_maximum_sizes "
    "check_device_map check_tied_parameters_in_config check_tied_parameters_on_same_device compute_module_sizes "
    "dtype_byte_size find_tied_parameters get_balanced_memory get_max_layer_size get_max_memory "
    "has_4bit_bnb_layers has_offloaded_params infer_auto_device_map load_and_quantize_model "
    "load_checkpoint_in_model load_offloaded_weight load_offloaded_weights named_module_tensors offload_state_dict "
    "offload_weight retie_parameters save_offload_index set_module_tensor_to_device get_module_children_bottom_up "
    "extract_submodules_state_dict ensure_weights_retied":
        "xshard places and shards the whole model (prepare; offload_params in the config); "
        "`xshard estimate` gives the memory per rank",
    "ComputeEnvironment PrepareForLaunch SageMakerDistributedType TORCH_LAUNCH_PARAMS "
    "TORCH_DISTRIBUTED_OPERATION_TYPES clear_environment convert_dict_to_env_variables "
    "get_cpu_distributed_information get_gpu_info get_int_from_env install_xla is_port_in_use "
    "parse_choice_from_env parse_flag_from_env patch_environment prepare_multi_gpu_env "
    "prepare_sagemager_args_inputs prepare_simple_launcher_cmd_env prepare_tpu purge_accelerate_environment "
    "set_numa_affinity write_basic_config check_os_kernel check_cuda_p2p_ib_support get_current_device_type "
    "are_libraries_initialized is_habana_gaudi1 MITA_PROFILING_AVAILABLE_PYTORCH_VERSION "
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": _OWN_LAUNCH,
    "DynamoBackend TorchDynamoPlugin compile_regions compile_regions_fsdp2 has_compiled_regions is_compiled_module":
        "pass dynamo_backend= (or Accelerate's own TorchDynamoPlugin as dynamo_plugin=) to the Accelerator: "
        "prepare compiles the model",
    "RNGType": "shuffles come from the Accelerator's seed on every rank (set_seed / seed=)",
    "KwargsHandler": "pass Accelerate's *Kwargs objects, or xshard.utils' (AutocastKwargs, GradScalerKwargs, ...)",
    "convert_outputs_to_fp32 convert_to_fp32 get_mixed_precision_context_manager get_grad_scaler":
        "the prepared model computes under mixed precision and returns fp32 outputs; accelerator.autocast() for "
        "other work, accelerator.scaler is the fp16 grad scaler",
    "clean_state_dict_for_safetensors id_tensor_storage save load load_state_dict":
        "accelerator.save(obj, path) / save_model(model, folder) write the files (tied weights once); "
        "torch.load or safetensors read them",
    "extract_model_from_parallel": "use accelerator.unwrap_model(model)",
    "find_executable_batch_size": MODULE_NAMES["find_executable_batch_size"],
    "CannotPadNestedTensorWarning CustomDtype TensorInformation concatenate find_batch_size find_device "
    "get_data_structure honor_type ignorant_find_batch_size initialize_tensors is_namedtuple is_tensor_information "
    "is_torch_tensor listify pad_input_tensors recursively_apply slice_tensors compare_versions is_torch_version "
    "convert_bytes convert_file_size_to_int get_pretty_name merge_dicts recursive_getattr is_peft_model "
    "str_to_bool": _ACCELERATE_HELPER,
    "is_4bit_bnb_available is_8bit_bnb_available is_aim_available is_amdsmi_available is_bf16_available "
    "is_bitsandbytes_multi_backend_available is_bnb_available is_boto3_available is_clearml_available "
    "is_comet_ml_available is_cuda_available is_datasets_available is_deepspeed_available is_dvclive_available "
    "is_fp16_available is_fp8_available is_hpu_available is_import_timer_available is_lomo_available "
    "is_matplotlib_available is_megatron_lm_available is_mlflow_available is_mlu_available is_mps_available "
    "is_msamp_available is_musa_available is_neuron_available is_npu_available is_pandas_available "
    "is_peft_available is_pippy_available is_pynvml_available is_pytest_available is_rich_available "
    "is_rocm_available is_sagemaker_available is_schedulefree_available is_sdaa_available is_swanlab_available "
    "is_tensorboard_available is_timm_available is_torch_xla_available is_torchao_available "
    "is_torchdata_available is_torchdata_stateful_dataloader_available is_torchvision_available "
    "is_trackio_available is_transformer_engine_available is_transformer_engine_mxfp8_available "
    "is_transformers_available is_triton_available is_wandb_available is_weights_only_available "
    "is_xccl_available is_xpu_available":
        "Accelerate's probe of an installed package or device: import it from accelerate.utils, or ask "
        "importlib.util.find_spec(name); accelerator.supports('bf16') says what this device computes in",
})


def missing_name(module: str, name: str, ways: dict[str, str]) -> ImportError | AttributeError:
    """The error for ``module.name`` (a module's ``__getattr__``): an ImportError naming xshard's way for
    Accelerate's names in ``ways`` (an ImportError so that ``from module import name`` shows it: Python replaces
    an AttributeError there by its own "cannot import name"), a plain AttributeError for any other name."""
    way = ways.get(name)
    if way is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return ImportError(f"{module}.{name} is Accelerate's (accelerate.utils.{name}); xshard does not have it: {way}",
                       name=module)
