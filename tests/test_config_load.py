"""XShardConfig.load: precedence, XSHARD_* variables, one warning, contradictions, error messages."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from xshard.config import XShardConfig, XShardConfigError, XShardConfigWarning
from xshard.errors import XShardError


@pytest.fixture
def xshard_yaml(tmp_path):
    path = tmp_path / "xshard.yaml"
    path.write_text("stage: 2\nmixed_precision: bf16\ngradient_accumulation_steps: 4\nseed: 7\n")
    return path


def test_defaults():
    config = XShardConfig.load(env={})
    assert config == XShardConfig()
    assert (config.stage, config.mixed_precision, config.backend) == (3, "no", "auto")


def test_precedence_override_beats_env_beats_file_beats_default(xshard_yaml):
    env = {"XSHARD_STAGE": "1", "XSHARD_MIXED_PRECISION": "fp16"}
    config = XShardConfig.load(xshard_yaml, overrides={"stage": 0}, env=env)
    assert config.stage == 0  # override
    assert config.mixed_precision == "fp16"  # env over file
    assert config.gradient_accumulation_steps == 4  # file over default
    assert config.seed == 7
    assert config.offload_params is False  # default


def test_xshard_config_variable_names_the_file(xshard_yaml):
    config = XShardConfig.load(env={"XSHARD_CONFIG": str(xshard_yaml), "XSHARD_SEED": "11"})
    assert (config.stage, config.seed) == (2, 11)


def test_env_values_are_parsed_per_field():
    env = {"XSHARD_OFFLOAD_OPTIMIZER": "true", "XSHARD_TRANSFORMER_LAYER_CLS_TO_WRAP": "Qwen2DecoderLayer, Norm",
           "XSHARD_GRADIENT_CLIPPING": "1.5", "XSHARD_DEVICES": "auto", "XSHARD_REDUCE_DTYPE": "float32",
           "XSHARD_OPTIMIZER": '{"type": "AdamW", "params": {"lr": 1e-5}}', "XSHARD_STAGE": "SHARD_GRAD_OP",
           "XSHARD_SEED": "none", "XSHARD_UNRELATED_THING": "whatever"}
    config = XShardConfig.load(env=env)
    assert config.offload_optimizer is True
    assert config.transformer_layer_cls_to_wrap == ["Qwen2DecoderLayer", "Norm"]
    assert (config.gradient_clipping, config.devices, config.reduce_dtype) == (1.5, None, "fp32")
    assert config.optimizer == {"type": "AdamW", "params": {"lr": 1e-5}}
    assert (config.stage, config.seed) == (2, None)


def test_a_bad_env_value_names_the_variable():
    with pytest.raises(XShardConfigError, match=r"XSHARD_STAGE: '5' is not valid; expected 0, 1, 2, 3"):
        XShardConfig.load(env={"XSHARD_STAGE": "5"})
    with pytest.raises(XShardConfigError, match=r"XSHARD_OFFLOAD_PARAMS: 'maybe' is not valid; expected true or"):
        XShardConfig.load(env={"XSHARD_OFFLOAD_PARAMS": "maybe"})


def test_from_another_config_with_overrides_and_alias():
    base = XShardConfig(stage=2, seed=1)
    config = XShardConfig.load(base, overrides={"xla_fsdp_grad_ckpt": True}, env={"XSHARD_SEED": "2"})
    assert (config.stage, config.seed, config.activation_checkpointing) == (2, 2, True)
    assert base.seed == 1


def test_unknown_keys_suggest_the_right_name(tmp_path):
    with pytest.raises(XShardConfigError, match=r"unknown key 'mixed_precison'; did you mean 'mixed_precision'"):
        XShardConfig.load({"mixed_precison": "bf16"}, env={})
    with pytest.raises(XShardConfigError, match=r"overrides: unknown key 'stag'; did you mean 'stage'"):
        XShardConfig.load(overrides={"stag": 1}, env={})


def test_fsdp_names_and_yaml_false_spellings():
    config = XShardConfig(stage="FULL_SHARD", backward_prefetch="BACKWARD_POST", state_dict_type="SHARDED_STATE_DICT",
                          auto_wrap_policy="NO_WRAP", mixed_precision=False)
    assert (config.stage, config.backward_prefetch, config.state_dict_type) == (3, "post", "sharded")
    assert (config.auto_wrap_policy, config.mixed_precision) == ("none", "no")
    # YAML 1.1 reads an unquoted `no` as false
    assert XShardConfig.load({"mixed_precision": False}, env={}).mixed_precision == "no"


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 4}, r"stage: 4 is not valid; expected 0, 1, 2, 3 or one of FULL_SHARD"),
    ({"stage": "HYBRID_SHARD", "shard_group_size": "half"}, r"shard_group_size: 'half' is not valid; expected null"),
    ({"mixed_precision": "fp8"}, r"mixed_precision: 'fp8' is not valid; expected one of no, bf16, fp16"),
    ({"backend": "ipu"}, r"backend: 'ipu' is not valid; expected one of auto, tpu, xla, npu, cuda, mps, cpu"),
    ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps: 0 is not valid; expected an integer >= 1"),
    ({"gradient_accumulation_steps": 2.5}, r"gradient_accumulation_steps: 2.5 is not valid"),
    ({"bucket_size_mb": 0}, r"bucket_size_mb: 0 is not valid; expected a number > 0"),
    ({"optimizer": {"params": {}}}, r"optimizer: .* expected a mapping \{\"type\": NAME"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, r"optimizer\.params\.betas"),
    ({"transformer_layer_cls_to_wrap": ["ok", 3]}, r"transformer_layer_cls_to_wrap: .* list of class names"),
    ({"offload_params": "sometimes"}, r"offload_params: 'sometimes' is not valid; expected true or false"),
])
def test_invalid_values_name_the_key_the_value_and_the_choices(kwargs, match):
    with pytest.raises(XShardConfigError, match=match):
        XShardConfig(**kwargs)


def test_offload_at_stage_0_is_a_contradiction_naming_where_each_came_from(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}))
    with pytest.raises(XShardConfigError) as info:
        XShardConfig.load(path, env={})
    message = str(info.value)
    assert "need stage 1, 2 or 3" in message
    assert "stage from zero_optimization.stage in" in message
    assert "offload_optimizer from zero_optimization.offload_optimizer.device in" in message


def test_bf16_and_fp16_both_enabled_is_a_contradiction():
    with pytest.raises(XShardConfigError, match=r"fp16\.enabled=.*contradicts bf16\.enabled"):
        XShardConfig.load({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, env={})


def test_train_batch_size_must_match_micro_accum_world():
    data = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
            "zero_optimization": {"stage": 2}}
    assert XShardConfig.load(data, env={"WORLD_SIZE": "4"}).train_batch_size == 32
    with pytest.raises(XShardConfigError, match=r"train_batch_size=32 != .* world size 2 \(= 16\)"):
        XShardConfig.load(data, env={"WORLD_SIZE": "2"})
    # DeepSpeed derives a missing accumulation from the other two
    derived = {k: v for k, v in data.items() if k != "gradient_accumulation_steps"}
    assert XShardConfig.load(derived, env={"WORLD_SIZE": "4"}).gradient_accumulation_steps == 4
    with pytest.raises(XShardConfigError, match="train_batch_size"):
        XShardConfig(train_batch_size=10, train_micro_batch_size_per_gpu=2, devices=4)


def test_the_unused_keys_warning_comes_once_listing_all(tmp_path):
    data = {"zero_optimization": {"stage": 3, "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9},
            "steps_per_print": 100}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        XShardConfig.load(data, env={})
    config_warnings = [w for w in caught if issubclass(w.category, XShardConfigWarning)]
    assert len(config_warnings) == 1
    message = str(config_warnings[0].message)
    for key in ("zero_optimization.sub_group_size", "zero_optimization.stage3_max_live_parameters", "steps_per_print"):
        assert message.count(key) == 1
    assert config_warnings[0].filename == __file__  # points at the caller's line


def test_no_warning_for_a_clean_file(xshard_yaml):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        XShardConfig.load(xshard_yaml, env={})


@pytest.mark.parametrize("content, match", [
    (b"\xff\xfe\x00garbage", "not a UTF-8 text file"),
    (b"stage: [1, 2", r"bad.yaml, line 1, column 13: not valid YAML \(while parsing a flow sequence expected"),
    (b"- 1\n- 2\n", "must be a mapping of keys to values, not list"),
    (b'{"zero_optimization": 3}', r"zero_optimization: 3 is not valid; expected a mapping"),
])
def test_malformed_files_are_config_errors(tmp_path, content, match):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(XShardConfigError, match=match):
        XShardConfig.load(path, env={})


def test_missing_file_and_cli_friendly_error_class(tmp_path):
    with pytest.raises(XShardConfigError, match="not found") as info:
        XShardConfig.load(tmp_path / "nope.yaml", env={})
    assert isinstance(info.value, XShardError) and isinstance(info.value, ValueError)
    assert info.value.exit_code == 2


def test_to_sharding_options():
    config = XShardConfig(stage="SHARD_GRAD_OP", mixed_precision="fp16", reduce_dtype="fp32", offload_params=True,
                          transformer_layer_cls_to_wrap="Block", activation_checkpointing=True, bucket_size_mb=10,
                          max_inflight_all_gathers=3, keep_norms_fp32=True, backward_prefetch="none")
    options = config.to_sharding_options()
    assert options.stage == 2
    assert (options.param_dtype, options.reduce_dtype, options.buffer_dtype) == (torch.float16, torch.float32, None)
    assert options.offload_params and not options.offload_optimizer
    assert options.transformer_layer_cls_to_wrap == ["Block"]
    assert options.activation_checkpointing and options.keep_norms_fp32
    assert (options.bucket_size_mb, options.max_inflight_all_gathers, options.backward_prefetch) == (10, 3, "none")
    assert XShardConfig().to_sharding_options().param_dtype is None


def test_to_sharding_options_takes_the_jobs_facts_and_is_built_whole():
    """World size, output dtype and weights read from a checkpoint go in; nothing is changed afterwards."""
    bf16 = XShardConfig(mixed_precision="bf16")
    options = bf16.to_sharding_options(world_size=2, output_dtype=torch.float32)
    assert options.output_dtype == torch.float32 and options.sync_module_states  # rank 0's weights broadcast
    assert not bf16.to_sharding_options(world_size=1).sync_module_states
    assert not bf16.to_sharding_options(world_size=2, weights_from_checkpoint=True).sync_module_states
    assert XShardConfig(sync_module_states=True).to_sharding_options().sync_module_states  # asked for: kept
    # the output cast belongs to mixed precision: in fp32 the outputs are left as computed
    assert XShardConfig().to_sharding_options(output_dtype=torch.float32).output_dtype is None
