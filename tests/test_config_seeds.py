"""The project's seed configs (DeepSpeed ZeRO-2/3 for Qwen on NPU, accelerate FSDP yamls) map to xshard fields."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from xshard.config import XShardConfig, XShardConfigError, XShardConfigWarning

CONFIGS = Path(__file__).parent / "data" / "configs"

# the run command of the Qwen fine-tune seed: torchrun --nproc_per_node=8 finetune.py --deepspeed ds_config.json
# --bf16 True --max_steps 2000 --per_device_train_batch_size 1 --learning_rate 1e-6 --weight_decay 0.
# --warmup_ratio 0.03 (the rest are TrainingArguments defaults)
QWEN_ARGS = {
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0,
    "learning_rate": 1e-6, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0,
    "bf16": True, "fp16": False, "max_steps": 2000, "warmup_ratio": 0.03,
}
TORCHRUN_8 = {"WORLD_SIZE": "8"}


def load_quietly(path: Path, **kwargs) -> tuple[XShardConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = XShardConfig.load(path, **kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, XShardConfigWarning)]
    return config, messages


def test_zero2_seed_maps_stage_precision_batch_and_optimizer():
    config, messages = load_quietly(CONFIGS / "ds_config_zero2.json", env=TORCHRUN_8, script_args=QWEN_ARGS)
    assert config.stage == 2
    assert config.mixed_precision == "bf16"
    assert config.reduce_dtype == "fp32"  # communication_data_type
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (1, 1)
    assert config.train_batch_size == 8  # 8 processes x 1 x 1
    assert config.gradient_clipping == 1.0
    assert config.optimizer == {
        "type": "AdamW", "params": {"lr": 1e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}
    assert not config.offload_params and not config.offload_optimizer
    # overlap_comm false cannot be honoured (xshard always overlaps); the bucket sizes have no analogue
    assert len(messages) == 1
    for key in ("zero_optimization.overlap_comm", "zero_optimization.allgather_bucket_size",
                "zero_optimization.reduce_bucket_size"):
        assert key in messages[0]
    assert "bf16.loss_scale" not in messages[0]  # loss scaling means nothing under bf16, in DeepSpeed too


def test_zero3_seed_maps_and_reports_the_stage3_knobs_it_ignores():
    config, messages = load_quietly(CONFIGS / "ds_config_zero3.json", env=TORCHRUN_8, script_args=QWEN_ARGS)
    assert config.stage == 3
    assert config.mixed_precision == "bf16"
    assert config.state_dict_type == "full"  # stage3_gather_16bit_weights_on_model_save: true
    assert config.optimizer["params"]["lr"] == 1e-6
    assert len(messages) == 1
    ignored = messages[0].split("ignored: ")[1].split(", ")
    assert sorted(ignored) == ["zero_optimization.stage3_max_live_parameters",
                               "zero_optimization.stage3_max_reuse_distance", "zero_optimization.sub_group_size"]
    options = config.to_sharding_options()
    assert options.stage == 3
    assert (options.param_dtype, options.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_zero3_seed_without_script_args_names_every_auto_and_its_provider():
    with pytest.raises(XShardConfigError) as info:
        XShardConfig.load(CONFIGS / "ds_config_zero3.json", env={})
    message = str(info.value)
    assert "ds_config_zero3.json" in message
    for key, provider in [("optimizer.params.lr", "learning_rate"), ("bf16.enabled", "bf16"),
                          ("gradient_clipping", "max_grad_norm"),
                          ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                          ("optimizer.params.betas", "adam_beta1 and adam_beta2")]:
        assert f"{key} <- {provider}" in message


def test_basic_zero_snippets():
    zero2, messages2 = load_quietly(CONFIGS / "ds_config_zero2_basic.json", env={})
    zero3, _ = load_quietly(CONFIGS / "ds_config_zero3_basic.json", env={})
    assert (zero2.stage, zero3.stage) == (2, 3)
    assert zero2.mixed_precision == zero3.mixed_precision == "no"
    assert "zero_optimization.round_robin_gradients" in messages2[0]


def test_accelerate_fsdp_seed():
    config, messages = load_quietly(CONFIGS / "accelerate_fsdp.yaml", env={})
    assert config.stage == 3  # fsdp_sharding_strategy: 1 = FULL_SHARD in accelerate's menu
    assert config.auto_wrap_policy == "transformer"
    assert config.transformer_layer_cls_to_wrap == ["BertLayer"]
    assert config.backward_prefetch == "pre"
    assert config.forward_prefetch is True
    assert config.sync_module_states is True
    assert config.state_dict_type == "full"
    assert config.mixed_precision == "bf16"
    assert (config.devices, config.num_nodes) == (2, 1)
    assert not config.offload_params
    assert messages == []  # every other key is a default that changes nothing


def test_accelerate_fsdp_peft_seed_offloads():
    config, _ = load_quietly(CONFIGS / "accelerate_fsdp_peft_t5.yaml", env={})
    assert config.stage == 3
    assert config.transformer_layer_cls_to_wrap == ["T5Block"]
    assert config.offload_params and config.offload_optimizer
    assert config.mixed_precision == "no"


def test_accelerate_multi_gpu_seed_is_plain_data_parallel_on_two_nodes():
    config, messages = load_quietly(CONFIGS / "accelerate_multi_gpu.yaml", env={})
    assert config.stage == 0
    assert config.mixed_precision == "fp16"
    assert (config.devices, config.num_nodes) == (4, 2)  # num_processes counts all nodes
    assert messages == []  # main_process_ip/port are launch settings: `xshard launch` reads them


def test_accelerate_deepspeed_plugin_seed():
    config, messages = load_quietly(CONFIGS / "accelerate_deepspeed_plugin.yaml", env={})
    assert config.stage == 2
    assert config.offload_params and config.offload_optimizer
    assert config.gradient_clipping == 0.7
    assert config.mixed_precision == "bf16"
    assert "deepspeed_config.zero3_init_flag" in messages[0]
