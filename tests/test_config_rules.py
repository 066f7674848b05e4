"""Each rule and spelling of the sharding options has one owner, ``xshard.sharding.options``: the config
(files, dicts, ``XSHARD_*``) and the core's ``ShardingOptions`` answer alike, with the same message."""

from __future__ import annotations

import pytest

from xshard.config import XShardConfig, XShardConfigError
from xshard.sharding.options import BACKWARD_PREFETCH_NAMES, STRATEGIES, ShardingOptions, ShardingOptionsError


@pytest.mark.parametrize("options", [
    {"offload_params": True}, {"offload_optimizer": True}, {"shard_group_size": 2}, {"shard_group_size": "node"},
    {"reshard_after_forward": True},
])
def test_a_stage_0_rule_gives_one_message_from_the_config_and_from_the_core(options):
    with pytest.raises(ShardingOptionsError) as core:
        ShardingOptions(stage=0, **options)
    with pytest.raises(XShardConfigError) as config:
        XShardConfig(stage=0, **options)
    assert str(config.value) == str(core.value)
    assert "stage 1, 2 or 3" in str(core.value)  # and the fix: raise the stage or unset the option


def test_the_config_names_where_each_value_of_a_broken_rule_was_set():
    with pytest.raises(XShardConfigError, match=r"set by: stage from overrides\['stage'\]; shard_group_size from "
                                                r"XSHARD_SHARD_GROUP_SIZE"):
        XShardConfig.load(overrides={"stage": 0}, env={"XSHARD_SHARD_GROUP_SIZE": "2"})


@pytest.mark.parametrize("name", sorted(STRATEGIES) + [n.lower() for n in STRATEGIES])
def test_every_strategy_name_means_the_same_stage_and_groups_in_the_config_and_the_core(name):
    config, core = XShardConfig(stage=name), ShardingOptions(stage=name)
    assert (config.stage, config.shard_group_size) == (core.stage, core.shard_group_size)


@pytest.mark.parametrize("name", sorted(BACKWARD_PREFETCH_NAMES) + ["BACKWARD_PRE", "No_Prefetch"])
def test_every_backward_prefetch_spelling_means_the_same_in_the_config_and_the_core(name):
    assert XShardConfig(backward_prefetch=name).backward_prefetch == ShardingOptions(backward_prefetch=name) \
        .backward_prefetch


@pytest.mark.parametrize("value", ["node", "NODE", "local_world_size", "world", "none", "", None, 4, "4"])
def test_every_shard_group_size_spelling_means_the_same_in_the_config_and_the_core(value):
    assert XShardConfig(stage=3, shard_group_size=value).shard_group_size == \
        ShardingOptions(stage=3, shard_group_size=value).shard_group_size
