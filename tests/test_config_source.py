"""A config is read once and its kind recorded; the sharding and what the job reports follow that one record.

What a user sees through ``xshard.Accelerator(config=...)``: the stage the model is sharded at, and
``accelerator.state.distributed_type`` / ``deepspeed_plugin`` / ``fsdp_plugin``, agree for every kind of
config (xshard's own, a ds_config, an accelerate yaml, a DeepSpeedPlugin's ``hf_ds_config``); a dict that
mixes xshard's and DeepSpeed's own keys is an error naming both readings and the fix.
"""

from __future__ import annotations

import json
import warnings

import pytest
from torch import nn

import xshard
from xshard.config import ConfigKind, XShardConfigError, read_source
from xshard.state import DistributedType
from xshard.utils import DeepSpeedPlugin


@pytest.fixture(autouse=True)
def one_cpu_process(clean_env):
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    return clean_env


def _accelerator(**kwargs) -> xshard.Accelerator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xshard.Accelerator(**kwargs)


def _sharded_stage(acc: xshard.Accelerator) -> int:
    """The stage the prepared model is really sharded at (its plan), not what the config says."""
    model = acc.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    return model.plan.stage


@pytest.mark.parametrize("config", [
    {"stage": 2, "train_micro_batch_size_per_gpu": 4},  # used to shard at 2 but report DEEPSPEED
    {"stage": 2},
])
def test_an_xshard_dict_with_a_key_deepspeed_shares_is_xshards_and_reported_as_fsdp(config):
    acc = _accelerator(config=config)
    assert _sharded_stage(acc) == 2
    assert acc.distributed_type == DistributedType.FSDP == acc.state.distributed_type
    assert acc.state.deepspeed_plugin is None
    assert acc.state.fsdp_plugin.sharding_strategy.name == "SHARD_GRAD_OP"
    acc.end()


def test_xshards_stage_beside_a_deepspeed_only_key_is_an_error_naming_both_readings_and_the_fix():
    with pytest.raises(XShardConfigError) as info:
        _accelerator(config={"stage": 3, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 4})
    message = str(info.value)
    assert "xshard's config (stage)" in message and "DeepSpeed ds_config (bf16)" in message
    assert "ZeRO-0" in message  # what the ds_config reading would do
    assert "stage -> zero_optimization.stage" in message and "xshard config --from" in message


def test_a_ds_config_shards_at_its_zero_stage_and_is_reported_as_deepspeed():
    acc = _accelerator(config={"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 4})
    assert _sharded_stage(acc) == 1
    assert acc.distributed_type == DistributedType.DEEPSPEED and acc.state.fsdp_plugin is None
    assert acc.state.deepspeed_plugin.zero_stage == 1
    assert acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 4
    acc.end()


def test_an_hf_ds_config_is_read_as_deepspeed_even_without_deepspeeds_own_keys():
    """DeepSpeedPlugin(hf_ds_config=...) says what the dict is: DeepSpeed's ZeRO-0 default, not xshard's stage 3."""
    acc = _accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"gradient_accumulation_steps": 2}))
    assert _sharded_stage(acc) == 0
    assert acc.distributed_type == DistributedType.DEEPSPEED and acc.state.deepspeed_plugin.zero_stage == 0
    assert acc.gradient_accumulation_steps == 2
    acc.end()


def test_an_accelerate_deepspeed_yaml_reports_its_ds_config_file_read_once(tmp_path):
    ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5}
    (tmp_path / "zero3.json").write_text(json.dumps(ds))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: zero3.json\n")
    source = read_source(tmp_path / "acc.yaml")
    assert source.kind is ConfigKind.ACCELERATE and source.deepspeed == ds
    acc = _accelerator(config=str(tmp_path / "acc.yaml"))
    assert _sharded_stage(acc) == 3 and acc.config.gradient_clipping == 0.5
    assert acc.distributed_type == DistributedType.DEEPSPEED
    assert acc.state.deepspeed_plugin.deepspeed_config == ds
    acc.end()


@pytest.mark.parametrize("data, kind", [
    ({"stage": 2, "train_micro_batch_size_per_gpu": 4}, ConfigKind.XSHARD),
    ({"train_batch_size": 16}, ConfigKind.XSHARD),  # only keys both formats share: xshard's
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, ConfigKind.DEEPSPEED),
    ({"activation_checkpointing": {"partition_activations": True}}, ConfigKind.DEEPSPEED),
    ({"distributed_type": "FSDP", "fsdp_config": {}}, ConfigKind.ACCELERATE),
    ({"fsdp_transformer_layer_cls_to_wrap": ["Block"], "xla": False}, ConfigKind.HF_FSDP),
])
def test_the_record_says_what_kind_of_config_it_is(data, kind):
    source = read_source(data, env={})
    assert source.kind is kind
    assert source.configured_by_deepspeed == (kind is ConfigKind.DEEPSPEED)


def test_trainer_deepspeed_is_read_as_a_ds_config_whatever_its_keys(tmp_path):
    """--deepspeed names a ds_config: one holding only keys xshard shares still runs DeepSpeed's ZeRO-0."""
    from xshard.trainer import TrainingArguments, sharding_config

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none",
                             deepspeed={"train_micro_batch_size_per_gpu": "auto"}, per_device_train_batch_size=2)
    config = sharding_config(args)
    assert config.stage == 0 and config.train_micro_batch_size_per_gpu == 2


def test_deepspeeds_marker_keys_are_none_of_xshards_and_the_shared_keys_are_all_xshard_fields():
    from xshard.config.deepspeed import MARKERS, SHARED_KEYS
    from xshard.config.schema import NATIVE_KEYS

    assert not MARKERS & NATIVE_KEYS and SHARED_KEYS <= NATIVE_KEYS
