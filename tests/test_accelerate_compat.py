"""Accelerate's constructor arguments and members on xshard, in one process.

What a script written for Accelerate passes and reads: each argument is honoured or named in one
warning; ``accelerator.state`` answers as Accelerate's does; a ds_config's ``"auto"`` values are filled
from the Accelerator's arguments and the prepared loader; trackers fail early with the package to
install; ``save`` / ``save_model`` / ``register_for_checkpointing`` behave as Accelerate's.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xshard
from xshard.config import XShardConfigError
from xshard.state import DistributedType
from xshard.tracking import TrackerError
from xshard.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


@pytest.fixture(autouse=True)
def _one_process(clean_env):
    yield


def _accelerator(**kwargs) -> xshard.Accelerator:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = xshard.Accelerator(**kwargs)
    acc.caught = [str(w.message) for w in caught]
    return acc


def test_accelerate_arguments_are_honoured(tmp_path):
    acc = _accelerator(
        mixed_precision="bf16", cpu=True, project_dir=str(tmp_path), log_with=["tensorboard"],
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, adjust_scheduler=False,
                                                                sync_with_dataloader=False, sync_each_batch=True),
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=11),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=__import__("datetime").timedelta(seconds=99)),
                         AutocastKwargs(enabled=False)],
    )
    assert acc.backend.name == "cpu" and acc.config.mixed_precision == "bf16" and acc.mixed_precision == "bf16"
    assert acc.gradient_accumulation_steps == 4 and acc.gradient_state.num_steps == 4
    assert acc.gradient_state.plugin_kwargs == {"num_steps": 4, "adjust_scheduler": False,
                                                "sync_with_dataloader": False, "sync_each_batch": True}
    assert acc.split_batches and not acc.job.step_scheduler_with_optimizer
    assert acc.project_dir == str(tmp_path) and acc.logging_dir == str(tmp_path)
    assert not any("no effect" in m for m in acc.caught)
    with acc.autocast():  # AutocastKwargs(enabled=False): bf16 autocast is off
        assert not torch.is_autocast_enabled("cpu")
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(12.0)), batch_size=6, shuffle=True))
    assert loader.batch_size == 6 and loader.sampler.seed == 11  # one process: the global batch of 6
    acc.end()


def test_arguments_without_meaning_are_named_in_one_warning():
    acc = _accelerator(rng_types=["torch", "generator"], device_placement=False,
                       dataloader_config=DataLoaderConfiguration(even_batches=False),
                       kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    ignored = [m for m in acc.caught if "no effect in xshard" in m]
    assert len(ignored) == 1
    for name in ("rng_types", "device_placement=False", "even_batches=False"):
        assert name in ignored[0]
    assert "GradScalerKwargs" not in ignored[0]  # it has a meaning: the fp16 scaler's settings
    acc.end()


def test_accelerate_own_objects_are_accepted(tmp_path):
    from accelerate import utils

    acc = _accelerator(project_config=utils.ProjectConfiguration(project_dir=str(tmp_path),
                                                                 automatic_checkpoint_naming=True),
                       gradient_accumulation_plugin=utils.GradientAccumulationPlugin(num_steps=3),
                       dataloader_config=utils.DataLoaderConfiguration(split_batches=True))
    assert acc.gradient_accumulation_steps == 3 and acc.split_batches
    net = Net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    path = acc.save_state()
    assert path == tmp_path / "checkpoints" / "checkpoint_0" and acc.save_iteration == 1
    acc.end()


def test_an_optimizer_over_parameters_outside_the_model_is_named_at_prepare_and_at_save(tmp_path, caplog):
    acc = _accelerator()
    with caplog.at_level(logging.WARNING, logger="xshard.accelerator"):
        acc.prepare(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))  # a different Net's parameters
    assert "SGD holds 6 parameter(s) that no prepared model holds" in caplog.text
    with pytest.raises(ValueError, match="in no prepared model: prepare the model with the optimizer"):
        acc.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # nothing half-written
    acc.end()


def test_fsdp_plugin_maps_onto_the_config_and_state_describes_it():
    plugin = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP", cpu_offload=True,
                                            state_dict_type="SHARDED_STATE_DICT", transformer_cls_names_to_wrap="Block")
    acc = _accelerator(fsdp_plugin=plugin)
    config = acc.config
    assert (config.stage, config.offload_params, config.offload_optimizer) == (2, True, True)
    assert config.state_dict_type == "sharded" and config.transformer_layer_cls_to_wrap == ["Block"]
    state = acc.state
    assert state.distributed_type == DistributedType.FSDP == acc.distributed_type
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.fsdp_plugin.sharding_strategy.name == "SHARD_GRAD_OP"
    assert state.fsdp_plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert state.fsdp_plugin.cpu_offload.offload_params is True
    assert state.deepspeed_plugin is None and not acc.use_distributed and acc.is_last_process
    acc.end()


def test_the_guides_fsdp_plugin_lines_run():
    """The PEFT guide: ``if getattr(accelerator.state, "fsdp_plugin", None) is not None:`` then a policy."""
    acc = _accelerator(stage=3)
    model = Net()
    with pytest.warns(UserWarning, match="policy function"):
        if getattr(acc.state, "fsdp_plugin", None) is not None:
            acc.state.fsdp_plugin.auto_wrap_policy = lambda module, recurse, nonwrapped_numel: True
    acc.state.fsdp_plugin.set_state_dict_type("SHARDED_STATE_DICT")
    assert acc.config.state_dict_type == "sharded"
    model = acc.prepare(model)
    assert model.stats()["units"] == 3  # the two Blocks and the root, from _no_split_modules
    acc.end()


def test_plain_data_parallel_reports_no_fsdp_plugin():
    acc = _accelerator(stage=0)
    assert acc.distributed_type == DistributedType.NO and acc.state.fsdp_plugin is None
    acc.end()


def _ds_config(**extra):
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}, **extra}


def test_ds_config_auto_values_are_filled_as_accelerate_fills_them(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_ds_config()))
    acc = _accelerator(config=str(path), gradient_accumulation_steps=4, mixed_precision="bf16")
    config = acc.config
    assert (config.stage, config.gradient_accumulation_steps, config.gradient_clipping) == (2, 4, 1.0)
    assert config.mixed_precision == "bf16" and config.train_micro_batch_size_per_gpu is None
    assert acc.distributed_type == DistributedType.DEEPSPEED and acc.state.fsdp_plugin is None
    acc.prepare(DataLoader(TensorDataset(torch.zeros(64, 2)), batch_size=8))  # the micro-batch comes from here
    assert (config.train_micro_batch_size_per_gpu, config.train_batch_size) == (8, 32)
    ds = acc.state.deepspeed_plugin
    assert ds.deepspeed_config["train_micro_batch_size_per_gpu"] == 8 and ds.get_value("bf16.enabled") is True
    assert ds.zero_stage == 2 and ds.gradient_accumulation_steps == 4 and ds.gradient_clipping == 1.0
    acc.end()


def test_ds_config_auto_without_any_source_is_an_error_naming_the_key():
    config = _ds_config(optimizer={"type": "AdamW", "params": {"lr": "auto"}})
    with pytest.raises(XShardConfigError, match=r"optimizer\.params\.lr"):
        xshard.Accelerator(config=config)


def test_deepspeed_plugin_fills_auto_and_maps_fields():
    from xshard.utils import DeepSpeedPlugin

    acc = _accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_ds_config(), gradient_clipping=0.3,
                                                        gradient_accumulation_steps=2))
    assert (acc.config.gradient_clipping, acc.config.gradient_accumulation_steps) == (0.3, 2)
    assert acc.config.mixed_precision == "no" and acc.distributed_type == DistributedType.DEEPSPEED
    acc.end()


def test_trackers_fail_in_the_constructor_with_the_fix(tmp_path):
    import importlib.util

    with pytest.raises(TrackerError, match="not supported by xshard.*tensorboard"):
        xshard.Accelerator(log_with="aim", project_dir=str(tmp_path))
    with pytest.raises(TrackerError, match="project_dir"):
        xshard.Accelerator(log_with="tensorboard")
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(TrackerError, match="pip install wandb"):
            xshard.Accelerator(log_with="wandb")


def test_custom_tracker_objects_are_used_as_they_are(tmp_path):
    class Recorder:
        name = "recorder"

        def __init__(self):
            self.calls = []

        def store_init_configuration(self, values):
            self.calls.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.calls.append(("log", values, step))

        def finish(self):
            self.calls.append(("finish",))

    recorder = Recorder()
    acc = _accelerator(log_with=[recorder])
    acc.init_trackers("run", config={"a": 1})
    acc.log({"loss": 0.5}, step=3)
    assert acc.get_tracker("recorder") is recorder
    acc.end_training()
    assert recorder.calls == [("config", {"a": 1}), ("log", {"loss": 0.5}, 3), ("finish",)]


def test_save_writes_torch_or_safetensors(tmp_path):
    from safetensors.torch import load_file

    acc = _accelerator()
    acc.save({"step": 3, "w": torch.ones(2)}, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt")["step"] == 3
    acc.save({"w": torch.arange(3.0)}, tmp_path / "w.safetensors", safe_serialization=True)
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.arange(3.0))
    with pytest.raises(TypeError, match="dict of tensors"):
        acc.save({"step": 3}, tmp_path / "bad.safetensors", safe_serialization=True)
    acc.end()


def test_save_model_shards_like_transformers_and_drops_stale_shards(tmp_path):
    from safetensors.torch import load_file

    acc = _accelerator()
    model = acc.prepare(Net())
    reference = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    (tmp_path / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    acc.save_model(model, tmp_path, max_shard_size="100B")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in tmp_path.glob("model-*.safetensors")) and len(files) > 1
    loaded = {}
    for name in files:
        loaded.update(load_file(tmp_path / name))
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    acc.save_model(model, tmp_path)  # fits one file now: the shard files and the index go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    acc.end()


def test_register_for_checkpointing_saves_and_restores_objects(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    acc = _accelerator()
    with pytest.raises(ValueError, match="item at index 0"):
        acc.register_for_checkpointing(object())
    counter = Counter()
    acc.register_for_checkpointing(counter)
    acc.prepare(Net())
    counter.n = 7
    acc.save_state(tmp_path / "ckpt")
    counter.n = 0
    acc.load_state(tmp_path / "ckpt")
    assert counter.n == 7
    acc.end()


def test_decorators_and_split_between_processes():
    acc = _accelerator()
    calls = []

    @acc.on_main_process
    def main_only(x):
        calls.append(x)
        return x

    @acc.on_process(process_index=1)
    def second_only():
        calls.append("second")

    assert main_only(3) == 3 and second_only() is None and calls == [3]
    with acc.split_between_processes(["a", "b", "c"]) as mine:
        assert mine == ["a", "b", "c"]
    acc.end()

    from xshard.metrics import split_between_processes

    with split_between_processes(["a", "b", "c"], rank=1, world_size=2, apply_padding=True) as part:
        assert part == ["c", "c"]
    with split_between_processes({"x": torch.arange(5)}, rank=0, world_size=2) as part:
        assert part["x"].tolist() == [0, 1, 2]


def test_set_seed_makes_runs_repeatable():
    from xshard.utils import set_seed

    set_seed(5)
    a = torch.randn(3)
    set_seed(5)
    assert torch.equal(a, torch.randn(3))
