"""Each reader's mapping: DeepSpeed ds_config, "auto" resolution, accelerate yaml, HF Trainer --fsdp."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest

from xshard.config import XShardConfig, XShardConfigError, XShardConfigWarning


def load(data, **kwargs) -> XShardConfig:
    kwargs.setdefault("env", {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", XShardConfigWarning)
        return XShardConfig.load(data, **kwargs)


def ignored_keys(data, **kwargs) -> list[str]:
    kwargs.setdefault("env", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        XShardConfig.load(data, **kwargs)
    found = [str(w.message) for w in caught if issubclass(w.category, XShardConfigWarning)]
    assert len(found) <= 1, "all ignored keys must come in one warning"
    return found[0].split("ignored: ")[1].split(", ") if found else []


# ----------------------------------------------------------------------------- DeepSpeed


def test_deepspeed_offload_devices():
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "none"}}
    config = load({"zero_optimization": zero})
    assert (config.offload_optimizer, config.offload_params) == (True, False)
    legacy = load({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert legacy.offload_optimizer


def test_deepspeed_nvme_offload_is_refused_with_the_alternatives():
    with pytest.raises(XShardConfigError, match=r"zero_optimization\.offload_param\.device.*'cpu' or 'none'"):
        load({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})


def test_deepspeed_without_zero_section_is_stage_0_as_in_deepspeed():
    assert load({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}).stage == 0


def test_deepspeed_fp16_and_gather_flag_and_communication_dtype():
    config = load({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
                   "communication_data_type": "bf16",
                   "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}})
    assert (config.mixed_precision, config.reduce_dtype, config.state_dict_type) == ("fp16", "bf16", "sharded")


def test_deepspeed_fp16_knobs_without_torch_analogue_are_reported():
    keys = ignored_keys({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 2},
                         "zero_optimization": {"stage": 2}})
    assert keys == ["fp16.loss_scale", "fp16.hysteresis"]


def test_deepspeed_stage0_reduce_bucket_size_sets_the_allreduce_bucket():
    config = load({"zero_optimization": {"stage": 0, "reduce_bucket_size": 5 * 2**20}})
    assert config.bucket_size_mb == 20.0  # 5 Mi fp32 elements


def test_deepspeed_scheduler_is_stored_for_the_script():
    data = {"zero_optimization": {"stage": 1},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                         "warmup_num_steps": 100, "warmup_type": "linear"}}}
    config = load(data)
    assert config.scheduler == {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                                               "warmup_num_steps": 100, "warmup_type": "linear"}}


def test_deepspeed_unknown_top_level_keys_are_reported_once_with_their_paths():
    keys = ignored_keys({"zero_optimization": {"stage": 2, "sub_group_size": 1e9, "overlap_comm": True},
                         "steps_per_print": 10, "wall_clock_breakdown": False, "flops_profiler": {"enabled": True}})
    assert keys == ["zero_optimization.sub_group_size", "steps_per_print", "flops_profiler"]


# ----------------------------------------------------------------------------- "auto"

AUTO_DS = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_min_lr": "auto",
                                                      "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
}
SCRIPT = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "max_grad_norm": 0.5,
          "learning_rate": 2e-5, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "weight_decay": 0.1,
          "bf16": False, "fp16": True, "max_steps": 1000, "warmup_ratio": 0.03}


def test_auto_values_come_from_the_script_like_the_hf_trainer():
    config = load(AUTO_DS, env={"WORLD_SIZE": "4"}, script_args=SCRIPT)
    assert config.train_micro_batch_size_per_gpu == 2
    assert config.gradient_accumulation_steps == 4
    assert config.train_batch_size == 4 * 2 * 4
    assert config.gradient_clipping == 0.5
    assert config.mixed_precision == "fp16"
    assert config.optimizer["params"] == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert config.scheduler["params"] == {"total_num_steps": 1000, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-5,
                                          "warmup_num_steps": 30}


def test_auto_accepts_a_namespace_and_warmup_steps_wins_over_ratio():
    args = argparse.Namespace(**{**SCRIPT, "warmup_steps": 50, "world_size": 2})
    config = load(AUTO_DS, script_args=args)
    assert config.scheduler["params"]["warmup_num_steps"] == 50
    assert config.train_batch_size == 2 * 2 * 4  # the script's world_size


def test_auto_train_batch_size_stays_unset_when_the_world_size_is_unknown():
    assert load(AUTO_DS, script_args=SCRIPT).train_batch_size is None


def test_auto_with_a_partial_script_names_only_what_is_missing():
    script = {k: v for k, v in SCRIPT.items() if k not in ("learning_rate", "max_steps")}
    with pytest.raises(XShardConfigError) as info:
        load(AUTO_DS, script_args=script)
    message = str(info.value)
    assert "optimizer.params.lr <- learning_rate" in message
    assert "scheduler.params.warmup_max_lr <- learning_rate" in message
    assert "scheduler.params.total_num_steps <- max_steps or num_training_steps" in message
    assert "gradient_clipping" not in message


def test_auto_with_a_non_numeric_script_value_is_a_config_error():
    with pytest.raises(XShardConfigError, match=r"optimizer\.params\.lr"):
        load(AUTO_DS, script_args={**SCRIPT, "learning_rate": "fast"})


def test_auto_on_a_key_xshard_maps_but_cannot_fill_is_an_error():
    with pytest.raises(XShardConfigError, match=r"zero_optimization\.stage: 'auto' is not valid"):
        load({"zero_optimization": {"stage": "auto"}})


# ----------------------------------------------------------------------------- accelerate


def test_accelerate_fsdp2_style_keys():
    data = {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 8,
            "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                            "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1_000_000,
                            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_activation_checkpointing": True,
                            "fsdp_cpu_ram_efficient_loading": False, "fsdp_offload_params": False}}
    config = load(data)
    assert config.stage == 2  # reshard_after_forward false = SHARD_GRAD_OP
    assert (config.auto_wrap_policy, config.min_num_params) == ("size", 1_000_000)
    assert config.state_dict_type == "sharded"
    assert config.activation_checkpointing
    assert config.devices == 8


@pytest.mark.parametrize("number, stage", [(1, 3), (2, 2), (3, 0), ("2", 2)])
def test_accelerate_numeric_sharding_strategy(number, stage):
    config = load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": number}})
    assert config.stage == stage


def test_accelerate_strategy_names_and_unprefixed_keys():
    config = load({"distributed_type": "FSDP", "fsdp_config": {"sharding_strategy": "SHARD_GRAD_OP",
                                                                "backward_prefetch": "BACKWARD_POST"}})
    assert (config.stage, config.backward_prefetch) == (2, "post")


@pytest.mark.parametrize("strategy, stage", [(4, 3), (5, 2), ("HYBRID_SHARD", 3), ("_HYBRID_SHARD_ZERO2", 2),
                                             ("hybrid_shard_zero2", 2)])
def test_accelerate_hybrid_sharding_shards_within_each_node(strategy, stage):
    config = load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": strategy}})
    assert (config.stage, config.shard_group_size) == (stage, "node")
    options = config.to_sharding_options()
    assert (options.stage, options.shard_group_size) == (stage, "node")


def test_hybrid_strategy_keeps_a_group_size_given_beside_it():
    config = load({"stage": "HYBRID_SHARD", "shard_group_size": 4})
    assert (config.stage, config.shard_group_size) == (3, 4)
    assert XShardConfig.load({}, env={"XSHARD_STAGE": "_HYBRID_SHARD_ZERO2"}).shard_group_size == "node"
    env = {"XSHARD_STAGE": "HYBRID_SHARD", "XSHARD_SHARD_GROUP_SIZE": "8"}
    assert (XShardConfig.load({}, env=env).stage, XShardConfig.load({}, env=env).shard_group_size) == (3, 8)


def test_fsdp2_reshard_after_forward_int_and_bool():
    config = load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": 8}})
    assert (config.stage, config.reshard_after_forward) == (3, 8)
    assert load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": "false"}}).stage == 2
    assert load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": True}}).stage == 3
    options = load({"stage": 3, "reshard_after_forward": 2}).to_sharding_options()
    assert options.reshard_after_forward == 2


def test_hf_trainer_hybrid_words():
    config = XShardConfig.from_hf_fsdp("hybrid_shard auto_wrap", {"transformer_layer_cls_to_wrap": ["Block"]})
    assert (config.stage, config.shard_group_size, config.auto_wrap_policy) == (3, "node", "transformer")
    assert (XShardConfig.from_hf_fsdp("hybrid_shard_zero2").stage,
            XShardConfig.from_hf_fsdp("hybrid_shard_zero2").shard_group_size) == (2, "node")


def test_deepspeed_mics_and_hpz_at_stage_3():
    config = load({"zero_optimization": {"stage": 3, "mics_shard_size": 8, "zero_hpz_partition_size": 4,
                                         "mics_hierarchical_params_gather": False}})
    assert (config.stage, config.shard_group_size, config.reshard_after_forward) == (3, 8, 4)
    off = {"zero_optimization": {"stage": 3, "mics_shard_size": -1, "zero_hpz_partition_size": 1}}
    assert (load(off).shard_group_size, load(off).reshard_after_forward) == (None, None)
    assert ignored_keys(off) == []
    # MiCS is a ZeRO-3 feature in DeepSpeed: at stage 2 it has no effect there, nor here (and says so)
    stage2 = {"zero_optimization": {"stage": 2, "mics_shard_size": 8}}
    assert load(stage2).shard_group_size is None
    assert ignored_keys(stage2) == ["zero_optimization.mics_shard_size"]


def test_group_size_errors_name_the_key_and_the_choices():
    with pytest.raises(XShardConfigError, match=r"shard_group_size: 0 is not valid; expected null \(every rank\)"):
        load({"stage": 3, "shard_group_size": 0})
    with pytest.raises(XShardConfigError, match=r"reshard_after_forward: 'often' is not valid"):
        load({"stage": 3, "reshard_after_forward": "often"})
    with pytest.raises(XShardConfigError, match="need sharded parameters"):
        load({"stage": 0, "shard_group_size": "node"})


def test_accelerate_contradictory_strategy_keys():
    with pytest.raises(XShardConfigError, match=r"contradicts fsdp_config\.fsdp_sharding_strategy"):
        load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD",
                                                           "fsdp_reshard_after_forward": False}})


def test_accelerate_fp8_and_uneven_processes_are_errors():
    with pytest.raises(XShardConfigError, match="fp8"):
        load({"distributed_type": "MULTI_GPU", "mixed_precision": "fp8"})
    with pytest.raises(XShardConfigError, match="num_processes=3 is not a multiple of num_machines=2"):
        load({"distributed_type": "MULTI_GPU", "num_processes": 3, "num_machines": 2})


def test_accelerate_use_cpu_and_fsdp_config_under_another_type():
    data = {"distributed_type": "MULTI_CPU", "use_cpu": True, "fsdp_config": {"fsdp_sharding_strategy": 1}}
    assert load(data).backend == "cpu"
    assert ignored_keys(data) == ["fsdp_config"]


def test_accelerate_deepspeed_config_file_is_read_relative_to_the_yaml(tmp_path):
    (tmp_path / "zero.json").write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": 1e9}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: zero.json\n  zero3_init_flag: false\n")
    assert load(tmp_path / "acc.yaml").stage == 3
    assert ignored_keys(tmp_path / "acc.yaml") == ["zero.json:zero_optimization.sub_group_size"]


# ----------------------------------------------------------------------------- HF Trainer --fsdp


def test_hf_fsdp_words_and_config():
    config = XShardConfig.from_hf_fsdp("full_shard auto_wrap offload",
                                       {"fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer",
                                        "backward_prefetch": "backward_pre", "forward_prefetch": "true"}, env={})
    assert config.stage == 3
    assert config.offload_params and config.offload_optimizer
    assert (config.auto_wrap_policy, config.transformer_layer_cls_to_wrap) == ("transformer",
                                                                              ["Qwen2DecoderLayer"])
    assert (config.backward_prefetch, config.forward_prefetch) == ("pre", True)


@pytest.mark.parametrize("words, fsdp_config, stage, policy", [
    ("shard_grad_op", None, 2, "none"),
    ("no_shard auto_wrap", {}, 0, "transformer"),
    (["full_shard"], {"min_num_params": 2000}, 3, "size"),  # the Trainer prefers size when min_num_params > 0
    (True, {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}, 3, "transformer"),
])
def test_hf_fsdp_wrap_policy_rule(words, fsdp_config, stage, policy):
    config = XShardConfig.from_hf_fsdp(words, fsdp_config, env={})
    assert (config.stage, config.auto_wrap_policy) == (stage, policy)


def test_hf_xla_fsdp_config():
    fsdp_config = {"xla": True, "xla_fsdp_grad_ckpt": True, "fsdp_transformer_layer_cls_to_wrap": ["GPT2Block"],
                   "xla_fsdp_settings": {"compute_dtype": "bfloat16", "fp32_reduce_scatter": True,
                                         "shard_param_on_dim_0": True}}
    config = XShardConfig.from_hf_fsdp("full_shard", fsdp_config, env={})
    assert config.backend == "xla"
    assert config.activation_checkpointing
    assert (config.mixed_precision, config.reduce_dtype) == ("bf16", "fp32")
    assert config.auto_wrap_policy == "transformer"


def test_hf_fsdp_config_path_and_bad_words(tmp_path):
    path = tmp_path / "fsdp_config.json"
    path.write_text(json.dumps({"fsdp_min_num_params": 10, "limit_all_gathers": True}))
    assert XShardConfig.from_hf_fsdp("shard_grad_op", str(path), env={}).min_num_params == 10
    with pytest.raises(XShardConfigError, match=r"contradicts fsdp 'full_shard'"):
        XShardConfig.from_hf_fsdp("full_shard shard_grad_op", env={})
    with pytest.raises(XShardConfigError, match="'fulll_shard' is not valid; expected words among full_shard"):
        XShardConfig.from_hf_fsdp("fulll_shard", env={})


def test_a_bare_hf_fsdp_config_file_is_detected(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_transformer_layer_cls_to_wrap": ["BertLayer"], "xla": False}))
    config = load(path)
    assert (config.stage, config.transformer_layer_cls_to_wrap) == (3, ["BertLayer"])


def test_accelerate_deepspeed_config_file_must_be_a_deepspeed_config(tmp_path):
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: acc.yaml\n")
    # a yaml pointing at itself is read once, as a DeepSpeed config, and its keys reported as ignored
    assert ignored_keys(tmp_path / "acc.yaml") == ["acc.yaml:distributed_type", "acc.yaml:deepspeed_config"]
    (tmp_path / "list.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                        "  deepspeed_config_file: missing.json\n")
    with pytest.raises(XShardConfigError, match="missing.json' not found"):
        load(tmp_path / "list.yaml")


def test_accelerate_menu_numbers_out_of_range_are_errors():
    with pytest.raises(XShardConfigError, match=r"fsdp_sharding_strategy: 0 is not valid; expected accelerate's menu "
                                                r"number 1 \(3\), 2 \(2\), 3 \(0\)"):
        load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": 0}})
    config = load({"distributed_type": "FSDP", "fsdp_config": {"fsdp_backward_prefetch_policy": 2,
                                                                "fsdp_state_dict_type": 3}})
    assert (config.backward_prefetch, config.state_dict_type) == ("post", "sharded")
