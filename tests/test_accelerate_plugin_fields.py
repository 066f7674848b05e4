"""Every field of Accelerate's plugin, ``*Kwargs`` and ``*Configuration`` constructors is honoured or named.

The installed accelerate's dataclasses are enumerated: a field without a row in
``xshard.accelerate_compat.conformance.plugins.PLUGIN_ROWS`` fails here (so a new Accelerate release shows its
new fields), xshard's class of the same name must take the field with Accelerate's default, a warned field set
away from its default is named in exactly one entry of the Accelerator's one warning, a default is never named,
and an honoured field reaches the config or the job.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import re
import warnings
from enum import Enum
from pathlib import Path
from typing import Any

import accelerate.utils as accelerate_utils
import pytest
import torch
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import xshard
import xshard.utils as xshard_utils
from xshard.accelerate_compat.conformance import plugins
from xshard.accelerate_compat.conformance.plugins import PLUGIN_ROWS
from xshard.config.accelerate_args import read_accelerate_args, settle_with_config
from xshard.config.schema import XShardConfig

TESTS = Path(__file__).parent


def _accelerate_classes() -> dict[str, type]:
    return {name: cls for name, cls in vars(accelerate_utils).items()
            if name.endswith(("Plugin", "Kwargs", "Configuration")) and isinstance(cls, type)
            and dataclasses.is_dataclass(cls)}


ACCELERATE = _accelerate_classes()


def _xshard_class(name: str) -> type | None:
    try:
        cls = getattr(xshard_utils, name)
    except (AttributeError, ImportError):  # xshard.utils names Accelerate's names it lacks in an ImportError
        return None
    return cls if dataclasses.is_dataclass(cls) else None


def _rows(status: str, test: str | None = None) -> list[tuple[str, str]]:
    return [(owner, name) for owner, fields in PLUGIN_ROWS.items() for name, row in fields.items()
            if row.status == status and (test is None or row.test == test)]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _comparable(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


# ------------------------------------------------------------------ the table and the classes


def test_every_field_of_accelerates_constructors_has_a_row_naming_a_real_test():
    missing = [f"{owner}.{f.name}" for owner, cls in ACCELERATE.items() for f in dataclasses.fields(cls)
               if f.name not in PLUGIN_ROWS.get(owner, {})]
    assert not missing, f"fields of the installed accelerate without a row in PLUGIN_ROWS: {missing}"
    stale = [f"{owner}.{name}" for owner, fields in PLUGIN_ROWS.items() for name in fields
             if owner not in ACCELERATE or name not in {f.name for f in dataclasses.fields(ACCELERATE[owner])}]
    assert not stale, f"rows for fields the installed accelerate does not have: {stale}"
    for owner, fields in PLUGIN_ROWS.items():
        for name, row in fields.items():
            file, test = row.test.split("::")
            assert re.search(rf"^def {test}\(", (TESTS / file).read_text(), re.M), (owner, name, row.test)


@pytest.mark.parametrize("name", sorted(n for n in ACCELERATE if _xshard_class(n) is not None))
def test_xshards_class_takes_every_field_with_accelerates_default(name):
    ours = {f.name: f for f in dataclasses.fields(_xshard_class(name))}
    for f in dataclasses.fields(ACCELERATE[name]):
        assert f.name in ours, f"xshard.utils.{name} lacks Accelerate's field {f.name}"
        assert _comparable(_default(ours[f.name])) == _comparable(_default(f)), (name, f.name)


def test_the_classes_scripts_build_from_xshard_utils_exist():
    for name in ("FullyShardedDataParallelPlugin", "DeepSpeedPlugin", "DistributedDataParallelKwargs",
                 "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs", "DataLoaderConfiguration",
                 "GradientAccumulationPlugin", "ProjectConfiguration", "ProfileKwargs"):
        assert _xshard_class(name) is not None, name
    assert xshard_utils.DDPCommunicationHookType.FP16.value == accelerate_utils.DDPCommunicationHookType.FP16.value


# ------------------------------------------------------------------ warned fields

#: the Accelerator argument each class is passed as (the others go in kwargs_handlers)
ARGUMENT = {"FullyShardedDataParallelPlugin": "fsdp_plugin", "DeepSpeedPlugin": "deepspeed_plugin",
            "DataLoaderConfiguration": "dataloader_config", "ProjectConfiguration": "project_config",
            "GradientAccumulationPlugin": "gradient_accumulation_plugin", "MegatronLMPlugin": "megatron_lm_plugin",
            "TorchTensorParallelPlugin": "torch_tp_plugin", "TorchDynamoPlugin": "dynamo_plugin"}


def _other(value: Any) -> Any:
    """A value other than ``value``, of its kind where it has one."""
    if isinstance(value, Enum):
        return next(m for m in type(value) if m is not value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 3
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, dict):
        return {"other": 1}
    return "other"


def _accelerates_object(name: str) -> Any:
    """Accelerate's object with its defaults (filled as its ``__post_init__`` fills them where it can run)."""
    cls = ACCELERATE[name]
    try:
        return cls()
    except ImportError:  # fp8 recipes need their library: the fields as declared
        obj = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            setattr(obj, f.name, _default(f))
        return obj


def _with(name: str, field: str, ours: bool) -> Any:
    """An object of class ``name`` with ``field`` away from its default: xshard's class built with it, or
    Accelerate's object with it set."""
    if ours:
        cls = _xshard_class(name)
        default = next(_default(f) for f in dataclasses.fields(cls) if f.name == field)
        return cls(**{field: _other(default)})
    obj = _accelerates_object(name)
    setattr(obj, field, _other(getattr(obj, field)))
    return obj


def _ignored(obj: Any, **extra: Any) -> list[str]:
    name = type(obj).__name__
    kwargs = {ARGUMENT[name]: obj} if name in ARGUMENT else {"kwargs_handlers": [obj]}
    settings = read_accelerate_args({**kwargs, **extra})
    settle_with_config(settings, XShardConfig.load(None, overrides=settings.overrides, env={}))
    return settings.ignored


_SIDES = {True: "xshard's class", False: "accelerate's class"}
#: (class, field, whether xshard's class is built) for each row warned in the Accelerator's one warning:
#: Accelerate's object always, xshard's where it has the class
_WARNED = [(owner, field, ours) for owner, field in _rows("warned", plugins.WARNED) for ours in (True, False)
           if not ours or _xshard_class(owner) is not None]


@pytest.mark.parametrize(("owner", "field", "ours"), _WARNED, ids=[f"{o}.{f}-{_SIDES[s]}" for o, f, s in _WARNED])
def test_each_warned_field_set_is_named_in_exactly_one_warning(owner, field, ours):
    ignored = _ignored(_with(owner, field, ours))
    naming = [entry for entry in ignored if owner in entry and re.search(rf"[(, ]{field}=", entry)]
    assert len(naming) == 1, ignored
    assert PLUGIN_ROWS[owner][field].how in naming[0]  # the table's words are the warning's


_CLASSES = [(owner, ours) for owner in sorted(ACCELERATE) for ours in (True, False)
            if not ours or _xshard_class(owner) is not None]


@pytest.mark.parametrize(("owner", "ours"), _CLASSES, ids=[f"{o}-{_SIDES[s]}" for o, s in _CLASSES])
def test_a_field_left_at_its_default_is_never_named(owner, ours):
    from xshard.config.accelerate_fields import IGNORED_CLASSES

    ignored = _ignored(_xshard_class(owner)() if ours else _accelerates_object(owner))
    # a class xshard does nothing with is named for being passed, with no field (TorchDynamoPlugin only in
    # kwargs_handlers: the dynamo_plugin argument is honoured)
    if IGNORED_CLASSES.get(owner, ("", False))[1] and owner not in ("TorchDynamoPlugin",):
        assert len(ignored) == 1 and f"{owner}()" in ignored[0], ignored
    else:
        assert not [e for e in ignored if owner in e], ignored


def test_comm_hook_at_stages_1_to_3_and_power_sgd_are_named():
    fp16 = xshard_utils.DistributedDataParallelKwargs(comm_hook=xshard_utils.DDPCommunicationHookType.FP16)
    assert any("comm_hook='fp16'): stages 1-3 reduce-scatter in the gradients' dtype" in e for e in _ignored(fp16))
    assert not [e for e in _ignored(fp16, fsdp_plugin=xshard_utils.FullyShardedDataParallelPlugin(
        sharding_strategy="NO_SHARD")) if "comm_hook" in e]  # stage 0: honoured
    power = accelerate_utils.DistributedDataParallelKwargs(comm_hook=accelerate_utils.DDPCommunicationHookType.POWER_SGD)
    assert [e for e in _ignored(power) if "comm_hook" in e] == [
        "DistributedDataParallelKwargs(comm_hook='power_sgd'): PowerSGD is not run, xshard all-reduces uncompressed"]


# ------------------------------------------------------------------ fields that need nothing, honoured fields

_NEED_NOTHING = _rows("same", plugins.NEED_NOTHING)


@pytest.mark.parametrize(("owner", "field"), _NEED_NOTHING, ids=[f"{o}.{f}" for o, f in _NEED_NOTHING])
def test_fields_that_need_nothing_are_accepted_without_a_warning(owner, field):
    obj = _with(owner, field, ours=True)
    if owner == "FullyShardedDataParallelPlugin" and field == "fsdp_version":
        obj.fsdp_version = 2
    assert not [e for e in _ignored(obj) if field in e]


def _settings(obj: Any) -> tuple[Any, XShardConfig]:
    name = type(obj).__name__
    settings = read_accelerate_args({ARGUMENT[name]: obj} if name in ARGUMENT else {"kwargs_handlers": [obj]})
    config = XShardConfig.load(settings.ds_config, overrides=settings.overrides, env={}) \
        if settings.ds_config is not None else XShardConfig.load(None, overrides=settings.overrides, env={})
    assert not settings.ignored, settings.ignored
    return settings, settle_with_config(settings, config)


U = xshard_utils
#: (class, field) -> (the object, what the settings and the config must show)
HONOURED_CASES: dict[tuple[str, str], tuple[Any, Any]] = {
    ("FullyShardedDataParallelPlugin", "reshard_after_forward"): (
        U.FullyShardedDataParallelPlugin(reshard_after_forward=False), lambda s, c: c.stage == 2),
    ("FullyShardedDataParallelPlugin", "backward_prefetch"): (
        U.FullyShardedDataParallelPlugin(backward_prefetch="BACKWARD_POST"), lambda s, c: c.backward_prefetch == "post"),
    ("FullyShardedDataParallelPlugin", "mixed_precision_policy"): (
        U.FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": torch.bfloat16,
                                                                 "reduce_dtype": torch.float32}),
        lambda s, c: (c.mixed_precision, c.reduce_dtype) == ("bf16", "fp32")),
    ("FullyShardedDataParallelPlugin", "auto_wrap_policy"): (
        U.FullyShardedDataParallelPlugin(auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={torch.nn.Linear})),
        lambda s, c: (c.auto_wrap_policy, c.transformer_layer_cls_to_wrap) == ("transformer", ["Linear"])),
    ("FullyShardedDataParallelPlugin", "sync_module_states"): (
        U.FullyShardedDataParallelPlugin(sync_module_states=True), lambda s, c: c.sync_module_states),
    ("FullyShardedDataParallelPlugin", "forward_prefetch"): (
        U.FullyShardedDataParallelPlugin(forward_prefetch=False), lambda s, c: c.forward_prefetch is False),
    ("FullyShardedDataParallelPlugin", "activation_checkpointing"): (
        U.FullyShardedDataParallelPlugin(activation_checkpointing=True), lambda s, c: c.activation_checkpointing),
    ("FullyShardedDataParallelPlugin", "cpu_ram_efficient_loading"): (
        U.FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True), lambda s, c: c.sync_module_states),
    ("FullyShardedDataParallelPlugin", "min_num_params"): (
        U.FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000),
        lambda s, c: (c.auto_wrap_policy, c.min_num_params) == ("size", 1000)),
    ("DeepSpeedPlugin", "hf_ds_config"): (
        U.DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2}),
        lambda s, c: c.stage == 1 and c.train_micro_batch_size_per_gpu == 2),
    ("DeepSpeedPlugin", "gradient_accumulation_steps"): (
        U.DeepSpeedPlugin(gradient_accumulation_steps=4), lambda s, c: c.gradient_accumulation_steps == 4),
    ("DeepSpeedPlugin", "gradient_clipping"): (
        U.DeepSpeedPlugin(gradient_clipping=0.5), lambda s, c: c.gradient_clipping == 0.5),
    ("DeepSpeedPlugin", "zero_stage"): (U.DeepSpeedPlugin(zero_stage=1), lambda s, c: c.stage == 1),
    ("DeepSpeedPlugin", "offload_optimizer_device"): (
        U.DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"), lambda s, c: c.offload_optimizer),
    ("DeepSpeedPlugin", "offload_param_device"): (
        U.DeepSpeedPlugin(zero_stage=3, offload_param_device="cpu", offload_optimizer_device="cpu"),
        lambda s, c: c.offload_params),
    ("DeepSpeedPlugin", "zero3_save_16bit_model"): (
        U.DeepSpeedPlugin(zero_stage=3, zero3_save_16bit_model=False), lambda s, c: c.state_dict_type == "sharded"),
    ("DistributedDataParallelKwargs", "bucket_cap_mb"): (
        U.DistributedDataParallelKwargs(bucket_cap_mb=5), lambda s, c: c.bucket_size_mb == 5),
    ("DataLoaderConfiguration", "use_seedable_sampler"): (
        U.DataLoaderConfiguration(use_seedable_sampler=True), lambda s, c: s.use_seedable_sampler),
    ("DataLoaderConfiguration", "non_blocking"): (
        U.DataLoaderConfiguration(non_blocking=True), lambda s, c: s.non_blocking),
    ("ProjectConfiguration", "total_limit"): (
        U.ProjectConfiguration(total_limit=2), lambda s, c: s.project.total_limit == 2),
    ("ProjectConfiguration", "iteration"): (U.ProjectConfiguration(iteration=5), lambda s, c: s.project.iteration == 5),
    **{("GradScalerKwargs", name): (U.GradScalerKwargs(**{name: value}),
                                    lambda s, c, name=name, value=value: s.scaler_kwargs == {name: value})
       for name, value in (("init_scale", 1024.0), ("growth_factor", 3.0), ("backoff_factor", 0.25),
                           ("growth_interval", 10), ("enabled", False))},
}
_HONOURED = _rows("same", plugins.HONOURED)


@pytest.mark.parametrize(("owner", "field"), _HONOURED, ids=[f"{o}.{f}" for o, f in _HONOURED])
def test_honoured_fields_reach_the_config_and_the_job(owner, field):
    assert (owner, field) in HONOURED_CASES, "a row names this test: give the field a case here"
    obj, shows = HONOURED_CASES[owner, field]
    settings, config = _settings(obj)
    assert shows(settings, config)


# ------------------------------------------------------------------ the scripts of Accelerate's examples


def test_the_fsdp_peak_memory_examples_plugin_builds_and_is_named_once():
    """examples/by_feature/fsdp_with_peak_mem_tracking.py's plugin, the import changed: no TypeError, one warning."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    plugin = xshard_utils.FullyShardedDataParallelPlugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = xshard.Accelerator(cpu=True, fsdp_plugin=plugin,
                                 kwargs_handlers=[xshard_utils.InitProcessGroupKwargs(
                                     timeout=datetime.timedelta(seconds=60))])
    acc.end()
    named = [str(w.message) for w in caught if "state_dict_config" in str(w.message)]
    assert len(named) == 1
    assert "FullyShardedDataParallelPlugin(state_dict_config=...)" in named[0]
    assert "FullyShardedDataParallelPlugin(optim_state_dict_config=...)" in named[0]


@pytest.mark.parametrize("offload", [False, True])
def test_accelerates_fsdp2_plugin_offloads_only_when_asked(offload):
    """FSDP2's plugin fills cpu_offload with an OffloadPolicy (no offload) or a CPUOffloadPolicy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Accelerate's own FSDP2 notes
        plugin = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=offload)
    settings = read_accelerate_args({"fsdp_plugin": plugin})
    assert (settings.overrides["offload_params"], settings.overrides["offload_optimizer"]) == (offload, offload)
    assert settings.ignored == []


def test_an_accelerate_yamls_cpu_ram_efficient_loading_is_read_not_warned(tmp_path):
    """The PEFT guide's FSDP yaml has fsdp_cpu_ram_efficient_loading: true (it was named as ignored, by the
    launcher and again by rank 0)."""
    from xshard.config.values import XShardConfigWarning

    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_cpu_ram_efficient_loading: true\n"
                    "  fsdp_sync_module_states: false\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", XShardConfigWarning)
        config = XShardConfig.load(str(path), env={})
    assert config.sync_module_states is True  # Accelerate turns it on with cpu_ram_efficient_loading


# ------------------------------------------------------------------ the doc
