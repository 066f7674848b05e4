"""Every field of Accelerate's plugin, ``*Kwargs`` and ``*Configuration`` constructors, and what xshard does with it.

``PLUGIN_ROWS``: class name -> field name -> ``Row``. A "warned" row's ``how`` is the text the Accelerator's one
warning gives for the field (``xshard.config.accelerate_fields``, which the reader uses), so the table and the
warning cannot say different things. ``tests/test_accelerate_plugin_fields.py`` fails on a field of the
installed accelerate without a row, and on a warned row whose field is not named in exactly one warning; the
conformance generator shows the rows in docs/accelerate-scripts.md.
"""

from __future__ import annotations

from xshard.config.accelerate_fields import IGNORED_CLASSES, IGNORED_FIELDS

from . import Row

_FIELDS_TEST = "test_accelerate_plugin_fields.py"
WARNED = f"{_FIELDS_TEST}::test_each_warned_field_set_is_named_in_exactly_one_warning"
NEED_NOTHING = f"{_FIELDS_TEST}::test_fields_that_need_nothing_are_accepted_without_a_warning"
HONOURED = f"{_FIELDS_TEST}::test_honoured_fields_reach_the_config_and_the_job"
_COMPAT = "test_accelerate_compat.py::test_accelerate_arguments_are_honoured"
_ORDER = ("test_data_accelerate_protocol.py::"
          "test_a_plain_shuffle_after_set_seed_is_accelerates_order_and_leaves_the_rng_where_accelerate_does")
_FSDP_COMPAT = "test_accelerate_compat.py::test_fsdp_plugin_maps_onto_the_config_and_state_describes_it"
_COMM_HOOK = "test_ddp_comm_hook.py::test_comm_hooks_at_stage_0_give_stock_accelerates_losses_and_weights"
_PROFILE = "test_accelerate_profile.py::test_profile_writes_accelerates_trace_files_on_each_process"
_COMPILE = "test_accelerate_dynamo.py::test_the_plugin_and_its_compile_keywords_are_accelerates"
_REGIONAL = "test_accelerate_dynamo.py::test_regional_compilation_is_warned_and_the_whole_model_compiled"


def _same(how: str, test: str = HONOURED) -> Row:
    return Row("same", how, test)


def _warned(owner: str, name: str) -> Row:
    return Row("warned", IGNORED_FIELDS[owner][name], WARNED)


def _whole(owner: str, names: tuple[str, ...]) -> dict[str, Row]:
    """Rows for a class xshard does nothing with: each field is named in the one warning that names the object."""
    return {name: Row("warned", IGNORED_CLASSES[owner][0], WARNED) for name in names}


def _table(owner: str, honoured: dict[str, Row]) -> dict[str, Row]:
    """``honoured`` rows and the warned rows of ``owner``'s fields that ``accelerate_fields`` names."""
    return {**honoured, **{name: _warned(owner, name) for name in IGNORED_FIELDS.get(owner, {})}}


_FSDP = "FullyShardedDataParallelPlugin"
_DS = "DeepSpeedPlugin"
_DDP = "DistributedDataParallelKwargs"

PLUGIN_ROWS: dict[str, dict[str, Row]] = {
    _FSDP: _table(_FSDP, {
        "fsdp_version": _same("1 or 2: one sharded core reads both versions' fields", NEED_NOTHING),
        "sharding_strategy": _same("FULL_SHARD / SHARD_GRAD_OP / NO_SHARD -> stage 3 / 2 / 0; HYBRID_SHARD(_ZERO2) "
                                   "-> 3 / 2 sharded within each node", _FSDP_COMPAT),
        "reshard_after_forward": _same("True / False -> stage 3 / 2; an int k -> stage 3 gathering within k ranks"),
        "backward_prefetch": _same("BACKWARD_PRE / BACKWARD_POST / None -> backward_prefetch"),
        "mixed_precision_policy": _same("param_dtype -> mixed_precision, reduce_dtype -> reduce_dtype (a buffer_dtype "
                                        "other than param_dtype is named in the warning)"),
        "auto_wrap_policy": _same("transformer / size / no wrap, or torch's policy functions (a partial's layer "
                                  "classes read); another function is named in the warning"),
        "cpu_offload": _same("-> offload_params and offload_optimizer", _FSDP_COMPAT),
        "state_dict_type": _same("FULL / SHARDED / LOCAL -> state_dict_type", _FSDP_COMPAT),
        "use_orig_params": _same("xshard always keeps the user's parameter objects", NEED_NOTHING),
        "sync_module_states": _same("-> sync_module_states (rank 0's weights broadcast)"),
        "forward_prefetch": _same("-> forward_prefetch"),
        "activation_checkpointing": _same("-> activation_checkpointing (each unit recomputed in backward)"),
        "cpu_ram_efficient_loading": _same("True turns sync_module_states on, as Accelerate does"),
        "transformer_cls_names_to_wrap": _same("-> transformer_layer_cls_to_wrap", _FSDP_COMPAT),
        "min_num_params": _same("-> min_num_params (size-based units)"),
    }),
    _DS: _table(_DS, {
        "hf_ds_config": _same("the ds_config (path, dict or HfDeepSpeedConfig) is the job's config, \"auto\" "
                              "values filled as Accelerate fills them"),
        "gradient_accumulation_steps": _same("-> gradient_accumulation_steps (and the ds_config's \"auto\")"),
        "gradient_clipping": _same("-> gradient_clipping (and the ds_config's \"auto\")"),
        "zero_stage": _same("-> stage"),
        "offload_optimizer_device": _same("cpu / none -> offload_optimizer"),
        "offload_param_device": _same("cpu / none -> offload_params"),
        "zero3_save_16bit_model": _same("True / False -> full / sharded checkpoints"),
    }),
    _DDP: _table(_DDP, {
        "bucket_cap_mb": _same("stage 0's all-reduce bucket size"),
        "find_unused_parameters": _same("xshard's stage 0 handles parameters without gradients as DDP does with it",
                                        NEED_NOTHING),
        "check_reduction": _same("torch ignores it (deprecated)", NEED_NOTHING),
        "gradient_as_bucket_view": _same("stage 0's gradients always are views of its buckets", NEED_NOTHING),
        "static_graph": _same("stage 0's buckets need no static-graph hint (the numbers are the same)", NEED_NOTHING),
        "comm_hook": _same("FP16 / BF16 at stage 0: the buckets all-reduced in that dtype as torch's hooks do; "
                           "POWER_SGD named in the warning; at stages 1-3 named in the warning (they reduce-scatter "
                           "in the gradients' dtype)", _COMM_HOOK),
    }),
    "GradScalerKwargs": {name: _same("the fp16 grad scaler's setting", HONOURED)
                         for name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")},
    "InitProcessGroupKwargs": _table("InitProcessGroupKwargs", {
        "timeout": _same("the collectives' timeout", _COMPAT),
    }),
    "AutocastKwargs": _table("AutocastKwargs", {
        "enabled": _same("enabled=False turns accelerator.autocast() off", _COMPAT),
    }),
    "DataLoaderConfiguration": _table("DataLoaderConfiguration", {
        "split_batches": _same("the loader's batch is the global batch, divided over the processes", _COMPAT),
        "use_seedable_sampler": _same("a plain shuffle's order from one seed and the epoch (else Accelerate's default "
                                      "order, from torch's RNG)", _ORDER),
        "data_seed": _same("the seedable sampler's seed (with use_seedable_sampler=True, as in Accelerate)", _COMPAT),
        "non_blocking": _same("batches moved to the device with non_blocking"),
        "use_stateful_dataloader": _same("prepared loaders always save and restore their position", NEED_NOTHING),
    }),
    "GradientAccumulationPlugin": {
        "num_steps": _same("-> gradient_accumulation_steps", _COMPAT),
        "adjust_scheduler": _same("skipped scheduler calls inside a window counted", _COMPAT),
        "sync_with_dataloader": _same("the loader's last batch closes the window", _COMPAT),
        "sync_each_batch": _same("gradients reduced on every micro-step", _COMPAT),
    },
    "ProjectConfiguration": _table("ProjectConfiguration", {
        "project_dir": _same("the run's folder (checkpoints/checkpoint_<n>)", _COMPAT),
        "logging_dir": _same("where trackers write", _COMPAT),
        "automatic_checkpoint_naming": _same("save_state() / load_state() without a folder use numbered folders",
                                             "test_accelerate_compat.py::test_accelerate_own_objects_are_accepted"),
        "total_limit": _same("only the newest N automatic checkpoints kept"),
        "iteration": _same("the number of the next automatic checkpoint"),
    }),
    "ProfileKwargs": {name: _same("what accelerator.profile() records", _PROFILE)
                      for name in ("activities", "schedule_option", "on_trace_ready", "record_shapes",
                                   "profile_memory", "with_stack", "with_flops", "with_modules", "output_trace_dir")},
    "TorchDynamoPlugin": {
        **{name: _same("Accelerator(dynamo_plugin=...): prepare compiles each model with these keywords", _COMPILE)
           for name in ("backend", "mode", "fullgraph", "dynamic", "options", "disable")},
        "use_regional_compilation": Row("warned", "xshard compiles the whole prepared model (named at prepare)",
                                        _REGIONAL),
    },
    "TorchTensorParallelPlugin": _whole("TorchTensorParallelPlugin", ("tp_size", "torch_device_mesh")),
    "AORecipeKwargs": _whole("AORecipeKwargs", ("config", "module_filter_func", "pad_inner_dim",
                                                "enable_fsdp_float8_all_gather")),
    "MSAMPRecipeKwargs": _whole("MSAMPRecipeKwargs", ("opt_level",)),
    "TERecipeKwargs": _whole("TERecipeKwargs", ("use_autocast_during_eval", "margin", "interval", "fp8_format",
                                                "amax_history_len", "amax_compute_algo", "override_linear_precision",
                                                "use_mxfp8_block_scaling")),
    "FP8RecipeKwargs": _whole("FP8RecipeKwargs", ("opt_level", "use_autocast_during_eval", "margin", "interval",
                                                  "fp8_format", "amax_history_len", "amax_compute_algo",
                                                  "override_linear_precision", "use_mxfp8_block_scaling",
                                                  "backend")),
    "MegatronLMPlugin": _whole("MegatronLMPlugin", (
        "tp_degree", "pp_degree", "use_custom_fsdp", "overlap_cpu_optimizer_d2h_h2d", "no_load_optim",
        "eod_mask_loss", "no_save_optim", "optimizer_cpu_offload", "use_precision_aware_optimizer",
        "decoder_last_pipeline_num_layers", "recompute_granularity", "recompute_method", "recompute_num_layers",
        "attention_backend", "expert_model_parallel_size", "context_parallel_size", "attention_dropout",
        "hidden_dropout", "attention_softmax_in_fp32", "expert_tensor_parallel_size", "calculate_per_token_loss",
        "use_rotary_position_embeddings", "num_micro_batches", "gradient_clipping", "sequence_parallelism",
        "recompute_activations", "use_distributed_optimizer", "pipeline_model_parallel_split_rank",
        "num_layers_per_virtual_pipeline_stage", "is_train_batch_min", "train_iters", "train_samples",
        "weight_decay_incr_style", "start_weight_decay", "end_weight_decay", "lr_decay_style", "lr_decay_iters",
        "lr_decay_samples", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction", "min_lr",
        "consumed_samples", "no_wd_decay_cond", "scale_lr_cond", "lr_mult", "megatron_dataset_flag", "seq_length",
        "encoder_seq_length", "decoder_seq_length", "tensorboard_dir", "set_all_logging_options", "eval_iters",
        "eval_interval", "return_logits", "custom_train_step_class", "custom_train_step_kwargs",
        "custom_model_provider_function", "custom_prepare_model_function",
        "custom_megatron_datasets_provider_function", "custom_get_batch_function", "custom_loss_function",
        "other_megatron_args")),
}
