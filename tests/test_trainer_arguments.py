"""xshard.trainer.TrainingArguments and sharding_config: the Trainer's arguments with the Trainer's meaning.

One process, no process group: ``--deepspeed`` with "auto" values and DeepSpeed not installed, the
``--fsdp`` words, the XLA fsdp_config (units by ``_no_split_modules``), ``--bf16`` with the device check,
the transformers-4 names of the openMind guide, the warnings/errors for what xshard cannot honour, and
arguments bound to the job (xshard's, TRL's ``SFTConfig``, stock) that still save (``training_args.bin``),
deep-copy and serialise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import warnings

import pytest
import torch
import transformers
from support.toy_backend import ToyBackend

from xshard.backends import register_backend, unregister_backend
from xshard.config import XShardConfigError, XShardConfigWarning
from xshard.errors import XShardError
from xshard.sharding.wrap import split_into_units
from xshard.trainer import TrainingArguments, TrainingArgumentsMixin, sharding_config

GUIDE_DS = "examples/qwen_finetune/ds_config_zero3.json"


@pytest.fixture(autouse=True)
def one_cpu_process(clean_env):
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    return clean_env


def _args(tmp_path, **kwargs) -> TrainingArguments:
    kwargs.setdefault("report_to", "none")
    return TrainingArguments(output_dir=str(tmp_path / "out"), **kwargs)


def _ds(**overrides) -> dict:
    data = json.loads(open(GUIDE_DS).read())
    data.update(overrides)
    return data


def _xshard_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, XShardConfigWarning)]


# ------------------------------------------------------------------------------------------ --deepspeed

def test_deepspeed_auto_values_are_filled_from_the_arguments_without_deepspeed(tmp_path):
    assert importlib.util.find_spec("deepspeed") is None  # the point: DeepSpeed is not installed here
    with pytest.raises(Exception, match="deepspeed"):  # the stock class needs it (PackageNotFoundError)
        transformers.TrainingArguments(output_dir=str(tmp_path), deepspeed=GUIDE_DS, use_cpu=True)

    args = _args(tmp_path, deepspeed=GUIDE_DS, bf16=True, per_device_train_batch_size=3,
                 gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-6, weight_decay=0.0,
                 adam_beta1=0.8, adam_epsilon=1e-7, max_steps=20)
    config = sharding_config(args)
    assert args.deepspeed == GUIDE_DS  # left as the user gave it
    assert args.deepspeed_plugin is None and args.hf_deepspeed_config is None
    assert config.stage == 3 and config.state_dict_type == "full" and config.reduce_dtype == "fp32"
    assert config.mixed_precision == "bf16"  # bf16.enabled "auto" <- --bf16
    assert config.train_micro_batch_size_per_gpu == 3
    assert config.gradient_accumulation_steps == 2
    assert config.train_batch_size == 1 * 3 * 2  # world size x micro x accumulation
    assert config.gradient_clipping == 0.5
    assert config.optimizer == {"type": "AdamW", "params": {"lr": 1e-6, "betas": [0.8, 0.999], "eps": 1e-7,
                                                            "weight_decay": 0.0}}


def test_deepspeed_takes_a_dict_and_json_text(tmp_path):
    for value in (_ds(), json.dumps(_ds())):
        args = _args(tmp_path, deepspeed=value, per_device_train_batch_size=2)
        config = sharding_config(args)
        assert config.stage == 3 and config.train_micro_batch_size_per_gpu == 2 and config.mixed_precision == "no"


def test_deepspeed_value_that_disagrees_with_the_arguments_is_an_error(tmp_path):
    data = _ds(gradient_accumulation_steps=4)
    with pytest.raises(XShardConfigError, match=r"gradient_accumulation_steps=4 vs TrainingArguments "
                                                r"gradient_accumulation_steps=1.*\"auto\""):
        _args(tmp_path, deepspeed=data)
    assert sharding_config(_args(tmp_path, deepspeed=data, gradient_accumulation_steps=4)).gradient_accumulation_steps == 4


def test_deepspeed_scheduler_and_unknown_optimizer_are_errors_naming_the_fix(tmp_path):
    data = _ds(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})
    with pytest.raises(XShardConfigError, match=r"scheduler 'WarmupDecayLR'.*--lr_scheduler_type"):
        _args(tmp_path, deepspeed=data)
    data = _ds(optimizer={"type": "Lamb", "params": {"lr": "auto"}})
    with pytest.raises(XShardConfigError, match=r"optimizer.type 'Lamb'.*remove the \"optimizer\" block"):
        _args(tmp_path, deepspeed=data)
    data = _ds(optimizer={"type": "Adam", "params": {"lr": "auto", "adam_w_mode": False}})
    with pytest.raises(XShardConfigError, match="adam_w_mode"):
        _args(tmp_path, deepspeed=data)
    with pytest.raises(XShardConfigError, match=r"--weight_decay 0.1: DeepSpeed decays every parameter"):
        _args(tmp_path, deepspeed=GUIDE_DS, weight_decay=0.1)
    with pytest.raises(XShardConfigError, match=r"--optim adafactor.*--optim adamw_torch"):
        _args(tmp_path, deepspeed=GUIDE_DS, optim="adafactor")
    no_block = _ds()
    del no_block["optimizer"]
    assert sharding_config(_args(tmp_path, deepspeed=no_block, weight_decay=0.1, optim="adafactor")).optimizer is None


def test_deepspeed_missing_file_names_it(tmp_path):
    with pytest.raises(XShardConfigError, match=r"--deepspeed .*nope.json.*no such file"):
        _args(tmp_path, deepspeed=str(tmp_path / "nope.json"))


def test_ignored_keys_and_arguments_are_named_once_in_one_warning(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        args = _args(tmp_path, deepspeed=GUIDE_DS, ddp_broadcast_buffers=False)
        sharding_config(args)  # the Trainer asks again: no second warning
    messages = _xshard_warnings(record)
    assert len(messages) == 1, messages
    assert "zero_optimization.stage3_max_live_parameters" in messages[0]
    assert "ddp_broadcast_buffers=False" in messages[0]
    assert messages[0].count("ddp_broadcast_buffers") == 1


# ------------------------------------------------------------------------------------------ --fsdp

@pytest.mark.parametrize(("words", "stage", "offload", "group"), [
    ("full_shard auto_wrap offload", 3, True, None),
    ("full_shard", 3, False, None),
    ("shard_grad_op auto_wrap", 2, False, None),
    ("no_shard", 0, False, None),
    ("hybrid_shard auto_wrap", 3, False, "node"),
])
def test_fsdp_words(tmp_path, words, stage, offload, group):
    args = _args(tmp_path, fsdp=words)
    config = sharding_config(args)
    assert args.fsdp == words and args.xshard_fsdp_words == words.split()
    assert (config.stage, config.offload_params, config.offload_optimizer) == (stage, offload, offload)
    assert config.shard_group_size == group
    assert config.auto_wrap_policy == "transformer"  # transformers 5 wraps blocks with or without auto_wrap
    assert sharding_config(dataclasses.replace(args, learning_rate=1e-3)).to_dict() == config.to_dict()  # a copy


def test_fsdp_config_classes_size_and_unknown_word(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer",
                                "activation_checkpointing": True}))
    config = sharding_config(_args(tmp_path, fsdp="full_shard auto_wrap", fsdp_config=str(path)))
    assert config.transformer_layer_cls_to_wrap == ["Qwen2DecoderLayer"] and config.activation_checkpointing
    config = sharding_config(_args(tmp_path, fsdp="full_shard auto_wrap", fsdp_config={"min_num_params": 1000}))
    assert (config.auto_wrap_policy, config.min_num_params) == ("size", 1000)
    with pytest.raises(XShardConfigError, match="full_shardd"):
        _args(tmp_path, fsdp="full_shardd")


def test_fsdp_and_deepspeed_together_is_an_error(tmp_path):
    with pytest.raises(XShardConfigError, match="give only one"):
        _args(tmp_path, fsdp="full_shard", deepspeed=GUIDE_DS)


def test_stock_arguments_give_the_same_config(tmp_path):
    for words in ("shard_grad_op auto_wrap", "full_shard offload"):
        stock = transformers.TrainingArguments(output_dir=str(tmp_path), fsdp=words, use_cpu=True, report_to="none")
        ours = _args(tmp_path, fsdp=words, use_cpu=True)
        assert sharding_config(stock).to_dict() == sharding_config(ours).to_dict()


def _tiny_qwen() -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return transformers.Qwen2ForCausalLM(config)


def test_xla_fsdp_config_wraps_by_no_split_modules(tmp_path, one_cpu_process):
    one_cpu_process.delenv("XSHARD_BACKEND")  # the fsdp_config picks the backend
    # the XLA example of the Trainer's FSDP docs; stock arguments here, since xshard's would start the
    # xla backend, which this environment does not have (tests/test_xla_users_scripts.py runs it on XLA)
    fsdp_config = {"xla": True, "xla_fsdp_grad_ckpt": True}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", fsdp_config=fsdp_config,
                                          use_cpu=False, report_to="none")
    config = sharding_config(args)
    assert (config.backend, config.stage, config.activation_checkpointing) == ("xla", 3, True)
    assert config.auto_wrap_policy == "transformer" and config.transformer_layer_cls_to_wrap is None
    units = split_into_units(_tiny_qwen(), config.to_sharding_options())
    assert [u.name for u in units] == ["", "model.layers.0", "model.layers.1", "model.layers.2"]


def test_xshards_arguments_start_the_xla_backend_an_xla_fsdp_config_file_asks_for(tmp_path, one_cpu_process):
    one_cpu_process.delenv("XSHARD_BACKEND")
    path = tmp_path / "xla_fsdp.json"
    path.write_text(json.dumps({"xla": True, "xla_fsdp_grad_ckpt": True}))
    # read before transformers loads the file: this environment has no torch_xla, and the error says so
    with pytest.raises(XShardError, match=r"xla backend, but it cannot run here: torch_xla is not installed"):
        _args(tmp_path, fsdp="full_shard", fsdp_config=str(path))


# ------------------------------------------------------------------------------------------ precision

def test_bf16_on_a_cpu_is_mixed_precision(tmp_path):
    args = _args(tmp_path, bf16=True)  # the stock class refuses this without --use_cpu
    assert args.bf16 and args.mixed_precision == "bf16" and args.xshard_precision_fallback is None
    assert sharding_config(args).mixed_precision == "bf16"


class _NoHalfBackend(ToyBackend):
    """A device without bf16 or fp16 (an NPU before the 910B has no bf16)."""

    name = "nohalf"

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32


def test_bf16_where_the_device_cannot_is_fp32_with_one_warning(tmp_path, one_cpu_process):
    register_backend("nohalf", _NoHalfBackend)
    one_cpu_process.setenv("XSHARD_BACKEND", "nohalf")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            args = _args(tmp_path, bf16=True, deepspeed=GUIDE_DS)
            config = sharding_config(args)
    finally:
        unregister_backend("nohalf")
    messages = _xshard_warnings(record)
    assert [m for m in messages if "--bf16" in m] == [messages[0]] and "fp32" in messages[0]
    assert not args.bf16 and args.mixed_precision == "no" and args.xshard_precision_fallback == "bf16"
    assert config.mixed_precision == "no"


def test_a_job_off_xla_where_torch_xla_is_installed_is_warned_of_transformers_tpu_paths(tmp_path, one_cpu_process):
    """A plain torchrun of a Trainer script on the cpu backend, in an environment with torch_xla: transformers
    takes its TPU paths (its logged loss would be rank 0's alone); one warning names USE_TORCH_XLA=0."""
    import transformers.utils

    from xshard.trainer.accelerator_setup import build_accelerator

    args = _args(tmp_path)
    find_spec = importlib.util.find_spec
    for xla_importable in (False, True):  # as transformers and the backend (Backend.default_env) see it
        one_cpu_process.setattr(transformers.utils, "is_torch_xla_available",
                                lambda *a, importable=xla_importable, **k: importable)
        one_cpu_process.setattr(importlib.util, "find_spec", lambda name, *a, importable=xla_importable: (
            (object() if importable else None) if name == "torch_xla" else find_spec(name, *a)))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            accelerator = build_accelerator(args)
        accelerator.end()
        named = [m for m in _xshard_warnings(record) if "USE_TORCH_XLA=0" in m]
        assert len(named) == int(xla_importable), named
    assert "cpu backend" in named[0] and "rank 0's alone" in named[0]


# ------------------------------------------------------------------------------------------ guide names

def test_transformers4_names_of_the_guide(tmp_path):
    parser = transformers.HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--warmup_ratio", "0.03", "--evaluation_strategy", "no",
         "--report_to", "none"])
    assert args.warmup_steps == 0.03 and args.get_warmup_steps(2000) == 60
    assert args.eval_strategy.value == "no"
    assert "warmup_ratio" not in args.to_dict()
    with pytest.raises(ValueError, match="both set the warmup"):
        _args(tmp_path, warmup_ratio=0.1, warmup_steps=5)


def test_parallelism_config_is_refused(tmp_path):
    class Parallelism:
        tp_size, cp_size, sp_size, dp_replicate_size = 2, 1, 1, 1

    args = _args(tmp_path)
    args.parallelism_config = Parallelism()
    with pytest.raises(XShardConfigError, match=r"parallelism_config \(tp_size=2\).*data parallel only"):
        sharding_config(args)


def test_the_mixin_joins_trls_sft_config(tmp_path):
    from dataclasses import dataclass

    import trl

    @dataclass
    class MyConfig(TrainingArgumentsMixin, trl.SFTConfig):
        pass

    parser = transformers.HfArgumentParser(MyConfig)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--deepspeed", GUIDE_DS, "--max_length", "64"])
    assert args.max_length == 64 and args.world_size == 1 and args.device == torch.device("cpu")
    config = sharding_config(args)
    # TRL turns bf16 on by default; the stock class refuses that on a CPU, xshard computes in bf16 here
    assert args.bf16 and config.mixed_precision == "bf16"
    assert (config.stage, config.train_micro_batch_size_per_gpu) == (3, args.per_device_train_batch_size)


# ------------------------------------------------------------------------------------------ saving and copying

def _bound(kind: str, tmp_path):
    """Arguments of ``kind`` as the Trainer holds them on xshard: bound to the job's Accelerator by the mixin
    (``create_accelerator_and_postprocess``), their backend as a running job leaves it."""
    from xshard.trainer.accelerator_setup import bind_arguments, build_accelerator

    out = str(tmp_path / kind)
    if kind == "xshard":
        args = TrainingArguments(output_dir=out, report_to="none")
    elif kind == "trl":
        import trl

        args = trl.SFTConfig(output_dir=out, report_to="none", bf16=False, max_length=64)
    else:
        args = transformers.TrainingArguments(output_dir=out, report_to="none")
    accelerator = build_accelerator(args)
    bind_arguments(args, accelerator)
    # a job's collectives hold locks (their counters, the hang watchdog); on 2 processes the barrier of
    # args.main_process_first() and the Trainer's every gather reach them, in one process this does
    args.distributed_state.backend.collectives.barrier()
    return args


@pytest.mark.parametrize("kind", ["xshard", "trl", "stock"])
def test_bound_arguments_save_copy_and_serialise(tmp_path, kind):
    import copy
    import io

    from xshard.trainer.arguments import SavedPlace

    args = _bound(kind, tmp_path)
    assert (args.world_size, args.process_index, args.device) == (1, 0, torch.device("cpu"))

    saved = io.BytesIO()
    torch.save(args, saved)  # what the Trainer writes as training_args.bin in every checkpoint
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert type(loaded) is type(args) and loaded.to_dict() == args.to_dict()
    # the saved arguments describe the run that saved them, joined to no job
    assert (loaded.world_size, loaded.process_index, loaded.device, loaded.should_save) == (1, 0, torch.device("cpu"),
                                                                                            True)
    assert isinstance(loaded.distributed_state.backend, SavedPlace)
    again = io.BytesIO()
    torch.save(copy.deepcopy(loaded), again)  # saved arguments copy and save again, as they are
    again.seek(0)
    assert torch.load(again, weights_only=False).distributed_state.backend == loaded.distributed_state.backend

    copied = copy.deepcopy(args)
    assert copied.to_dict() == args.to_dict() and copied.output_dir == args.output_dir
    # a copy answers from the same job: the process has one place in it
    assert copied.distributed_state.backend is args.distributed_state.backend
    with copied.main_process_first():
        pass

    assert json.loads(args.to_json_string())["output_dir"] == args.output_dir
    assert json.loads(json.dumps(args.to_dict())) == json.loads(args.to_json_string())


def test_a_saved_distributed_state_of_two_processes_refuses_to_wait_for_them():
    from xshard.backends.world import World
    from xshard.trainer.arguments import SavedPlace, XShardDistributedState

    state = XShardDistributedState(SavedPlace("cpu", "cpu", World(rank=1, world_size=2, local_rank=1), "cpu"))
    assert (state.process_index, state.num_processes, state.is_main_process, state.device) == (1, 2, False,
                                                                                             torch.device("cpu"))
    with pytest.raises(RuntimeError, match="unpickled.*process 1 of the 2 .*joined to no job"):
        state.wait_for_everyone()
