"""``sharding_config(args)``: a transformers ``TrainingArguments`` (xshard's, stock, TRL's ``SFTConfig``...)
turned into the ``XShardConfig`` its run uses, with the Trainer's meaning of each argument.

- ``--deepspeed ds_config.json`` (a path, a dict or JSON text) is read by xshard's DeepSpeed reader; its
  ``"auto"`` values are filled as the Trainer fills them (``HfTrainerDeepSpeedConfig``): micro batch,
  accumulation, ``train_batch_size`` (world x micro x accumulation), clipping from ``max_grad_norm``,
  the optimizer's lr/betas/eps/weight decay, bf16/fp16. A value that is not ``"auto"`` must agree with the
  argument, as the Trainer demands (else an error listing every disagreement). DeepSpeed need not be
  installed.
- ``--fsdp "full_shard auto_wrap offload"`` + ``--fsdp_config`` go through the FSDP reader. As in
  transformers 5 the units are transformer blocks whether or not ``auto_wrap`` is given (the classes in
  ``transformer_layer_cls_to_wrap``, else the model's ``_no_split_modules``), by size when
  ``min_num_params`` > 0; ``xla: true`` selects the xla backend, ``xla_fsdp_grad_ckpt`` activation
  checkpointing per unit.
- Without either the job runs the config from ``--config``/``XSHARD_*`` of the launcher (stage 3 by
  default), with the arguments' precision, accumulation and clipping. A ds_config given that way
  (``xshard launch --config ds_config.json``) is read as ``--deepspeed`` reads it, "auto" values and
  checks included, as the Trainer treats the ds_config of ``accelerate launch --config_file``.

A DeepSpeed ``optimizer`` block: the Trainer on xshard builds its AdamW from the arguments, which the
block's values must agree with (checked above), so the block describes the same optimizer. Two cases
would differ from DeepSpeed's, which builds the optimizer itself over every trainable parameter as one
group: a weight decay above 0 (the Trainer's AdamW exempts biases and norms) and an ``--optim`` other than
AdamW; both are errors naming the fix, as are block types other than Adam/AdamW. ``XShardConfig.optimizer``
holds the block. A DeepSpeed ``scheduler`` block is an error naming the fix (the Trainer's
``--lr_scheduler_type``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xshard.config import (
    ConfigKind,
    XShardConfig,
    XShardConfigError,
    XShardConfigWarning,
    parse_text,
    read_source,
)
from xshard.config.fsdp import hf_fsdp_items
from xshard.config.values import is_auto

__all__ = ["sharding_config"]

# DeepSpeed optimizer types xshard implements (DeepSpeed's "Adam" is AdamW unless adam_w_mode is false)
_ADAM_TYPES = ("adam", "adamw")
_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "fused"}
_FIX_SCHEDULER = ("remove the ds_config's \"scheduler\" block and choose the schedule with the Trainer's "
                  "--lr_scheduler_type and --warmup_steps (a number < 1 is a ratio of the total steps)")


def sharding_config(args: Any, env: Mapping[str, str] | None = None) -> XShardConfig:
    """The ``XShardConfig`` for a run with these ``TrainingArguments`` (see the module docstring).

    Arguments xshard cannot honour, and keys of the config files that have no effect, are named together
    in one ``XShardConfigWarning``; arguments that would change the results silently raise
    ``XShardConfigError`` naming the argument and the fix.
    """
    from xshard.runtime.launch_marker import mark_accelerator_built

    mark_accelerator_built()  # xshard launch: this job runs on xshard, whatever the settings read below say
    env = os.environ if env is None else env
    cached = getattr(args, "_xshard_config_cache", None)
    key = _cache_key(args)
    if cached is not None and cached[0] == key:
        return XShardConfig.load(cached[1], env={})  # a copy: no second warning
    _refuse(args)
    words = _fsdp_words(args)
    deepspeed = _deepspeed_source(args)
    if deepspeed is None and words is None:
        deepspeed = _launch_deepspeed(env)
    if deepspeed is not None and words is not None:
        raise XShardConfigError("--deepspeed and --fsdp both configure the sharding: give only one of them "
                                "(a ds_config.json, or the FSDP words with --fsdp_config)")
    overrides = _overrides(args, from_deepspeed=deepspeed is not None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XShardConfigWarning)
        if deepspeed is not None:
            config = _from_deepspeed(args, deepspeed, overrides, env)
        elif words is not None:
            config = XShardConfig.from_hf_fsdp(words, _fsdp_options(args), overrides=overrides, env=env)
        else:
            config = XShardConfig.load(None, overrides=overrides, env=env)
    ignored = [str(w.message) for w in caught if issubclass(w.category, XShardConfigWarning)]
    for other in caught:
        if not issubclass(other.category, XShardConfigWarning):
            warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    unhonoured = _unhonoured(args)
    if unhonoured:
        ignored.append("these TrainingArguments have no effect in xshard: " + "; ".join(unhonoured))
    if ignored and env.get("RANK", "0") == "0":
        warnings.warn(" | ".join(ignored), XShardConfigWarning, stacklevel=2)
    if key is not None:
        try:
            object.__setattr__(args, "_xshard_config_cache", (key, config.to_dict()))
        except (AttributeError, TypeError):  # frozen or slotted argument classes: no cache
            pass
    return config


# ------------------------------------------------------------------------------------------ reading args

def _deepspeed_source(args: Any) -> dict[str, Any] | str | None:
    """``--deepspeed``: a dict, JSON text or a file path (None when not given)."""
    value = getattr(args, "deepspeed", None)
    if not value:
        return None
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        data = parse_text(value.encode(), "--deepspeed (JSON text).json")
        return dict(data) if isinstance(data, Mapping) else data
    if isinstance(value, (str, os.PathLike)):
        if not Path(value).is_file():
            raise XShardConfigError(f"--deepspeed {os.fspath(value)!r}: no such file; pass the path of a "
                                    "ds_config.json (or a dict)")
        return os.fspath(value)
    raise XShardConfigError(f"--deepspeed: {value!r} is not valid; expected the path of a ds_config.json or a dict")


def _launch_deepspeed(env: Mapping[str, str]) -> str | None:
    """The launcher's ``--config`` (``XSHARD_CONFIG``) when it is a ds_config: the Trainer fills its "auto"
    values from its arguments, as under ``accelerate launch`` with a DeepSpeed config (None otherwise)."""
    path = env.get("XSHARD_CONFIG")
    if not path or not Path(path).is_file():
        return None  # the config reader names a missing file
    return path if read_source(path, env).kind is ConfigKind.DEEPSPEED else None


def _fsdp_words(args: Any) -> list[str] | None:
    """The ``--fsdp`` words as the user gave them (None when FSDP is off).

    transformers 5 turns the words into ``fsdp_config`` entries (``reshard_after_forward``, ``cpu_offload``)
    and ``fsdp=True``; xshard's arguments keep the words in ``xshard_fsdp_words`` instead, since they also
    name strategies transformers' FSDP2 refuses (hybrid_shard, no_shard)."""
    kept = getattr(args, "xshard_fsdp_words", None)
    if kept:
        return list(kept)
    fsdp = getattr(args, "fsdp", None)
    if not fsdp:
        return None
    if fsdp is True:
        return []  # the strategy, if any, is in fsdp_config; full_shard when none is
    return hf_fsdp_items(fsdp)


def _fsdp_options(args: Any) -> dict[str, Any] | None:
    options = getattr(args, "fsdp_config", None)
    if isinstance(options, (str, os.PathLike)):
        return options  # type: ignore[return-value]  # a path: XShardConfig.from_hf_fsdp reads it
    options = dict(options or {})
    # transformers 5 wraps transformer blocks by default (auto_wrap or not); min_num_params > 0: by size
    if "auto_wrap_policy" not in options and not (options.get("min_num_params") or 0) > 0:
        options["auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
    return options


def _flag(args: Any, *names: str) -> bool:
    return any(bool(getattr(args, n, False)) for n in names)


def _requested_precision(args: Any) -> str:
    """What ``--bf16``/``--fp16`` ask for (before a device fallback)."""
    fallback = getattr(args, "xshard_precision_fallback", None)
    if fallback:
        return fallback
    return "bf16" if _flag(args, "bf16") else "fp16" if _flag(args, "fp16") else "no"


def _is_xshards(args: Any) -> bool:
    """Arguments of a class with xshard's mixin (which sets up the devices through xshard's backend)."""
    return bool(getattr(type(args), "xshard_arguments", False))


def _world_size(args: Any, env: Mapping[str, str]) -> int:
    if not _is_xshards(args) and env.get("WORLD_SIZE", "").isdigit():
        return int(env["WORLD_SIZE"])  # stock arguments may see one process where the launcher started more
    return int(getattr(args, "world_size", 1) or 1)


def _overrides(args: Any, from_deepspeed: bool) -> dict[str, Any]:
    """Config fields the arguments decide (the Trainer's meaning), beyond the config file's."""
    overrides: dict[str, Any] = {}
    if not from_deepspeed:  # a ds_config's "auto" values are filled from the same arguments
        overrides["gradient_accumulation_steps"] = int(args.gradient_accumulation_steps)
        overrides["gradient_clipping"] = float(args.max_grad_norm or 0.0) or None
        precision = _requested_precision(args)
        if precision != "no":
            overrides["mixed_precision"] = precision
    if getattr(args, "xshard_precision_fallback", None):
        overrides["mixed_precision"] = "no"  # the device cannot: fp32 (the arguments warned once)
    if _flag(args, "use_cpu"):
        overrides["backend"] = "cpu"
    bucket = getattr(args, "ddp_bucket_cap_mb", None)
    if bucket:
        overrides["bucket_size_mb"] = float(bucket)
    return overrides


# ------------------------------------------------------------------------------------------ DeepSpeed

def _script_values(args: Any, env: Mapping[str, str]) -> dict[str, Any]:
    """The Trainer's sources of a ds_config's "auto" values (``HfTrainerDeepSpeedConfig``)."""
    values = {
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_grad_norm": args.max_grad_norm,
        "learning_rate": args.learning_rate,
        "adam_beta1": args.adam_beta1,
        "adam_beta2": args.adam_beta2,
        "adam_epsilon": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "warmup_steps": getattr(args, "warmup_steps", 0),
        "bf16": _requested_precision(args) == "bf16" or _flag(args, "bf16_full_eval"),
        "fp16": _requested_precision(args) == "fp16" or _flag(args, "fp16_full_eval"),
        "world_size": _world_size(args, env),
    }
    if getattr(args, "max_steps", -1) and args.max_steps > 0:
        values["max_steps"] = args.max_steps
    return values


def _check_optimizer(data: Mapping[str, Any], args: Any) -> None:
    section = data.get("optimizer")
    if section is None:
        return
    if not isinstance(section, Mapping):
        raise XShardConfigError(f"ds_config optimizer: {section!r} is not valid; expected "
                                '{"type": "AdamW", "params": {...}} or no optimizer block')
    kind = str(section.get("type", "")).lower()
    params = section.get("params") or {}
    fix = ("remove the \"optimizer\" block (the Trainer then builds its AdamW from --learning_rate, --adam_beta1/2, "
           "--adam_epsilon and --weight_decay, or the optimizer --optim names)")
    if kind not in _ADAM_TYPES:
        raise XShardConfigError(f"ds_config optimizer.type {section.get('type')!r}: xshard implements only DeepSpeed's "
                                f"Adam and AdamW; {fix}", ("optimizer",))
    if isinstance(params, Mapping) and params.get("adam_w_mode") is False:
        raise XShardConfigError("ds_config optimizer.params.adam_w_mode false (Adam with L2 decay): xshard "
                                f"implements DeepSpeed's AdamW only; {fix}", ("optimizer",))
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "adamw")))
    if not optim.startswith("adamw"):
        raise XShardConfigError(f"ds_config optimizer {section.get('type')!r} and --optim {optim}: DeepSpeed would "
                                f"train with its {section.get('type')}, the Trainer here with {optim}; {fix}, or "
                                "set --optim adamw_torch", ("optimizer",))
    if float(getattr(args, "weight_decay", 0.0) or 0.0) > 0:
        raise XShardConfigError(f"ds_config optimizer with --weight_decay {args.weight_decay}: DeepSpeed decays every "
                                "parameter, the Trainer's AdamW exempts biases and norm weights, so the runs would "
                                f"differ; {fix} (to train with the Trainer's groups), or set --weight_decay 0",
                                ("optimizer",))
    unknown = sorted(set(params) - _ADAM_PARAMS) if isinstance(params, Mapping) else []
    if unknown:
        raise XShardConfigError(f"ds_config optimizer.params {', '.join(unknown)}: not implemented by xshard's AdamW "
                                f"(it takes {', '.join(sorted(_ADAM_PARAMS))}); remove them or {fix}",
                                ("optimizer",))


def _node(data: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _check_agreement(data: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """A ds_config value that is not "auto" must equal the argument it stands for (the Trainer's rule)."""
    micro, accum = values["per_device_train_batch_size"], values["gradient_accumulation_steps"]
    pairs = [
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size"),
        ("gradient_accumulation_steps", accum, "gradient_accumulation_steps"),
        ("train_batch_size", values["world_size"] * micro * accum,
         "world size x per_device_train_batch_size x gradient_accumulation_steps"),
        ("gradient_clipping", values["max_grad_norm"], "max_grad_norm"),
        ("optimizer.params.lr", values["learning_rate"], "learning_rate"),
        ("optimizer.params.betas", [values["adam_beta1"], values["adam_beta2"]], "adam_beta1 + adam_beta2"),
        ("optimizer.params.eps", values["adam_epsilon"], "adam_epsilon"),
        ("optimizer.params.weight_decay", values["weight_decay"], "weight_decay"),
        ("fp16.enabled", values["fp16"], "fp16 | fp16_full_eval"),
        ("bf16.enabled", values["bf16"], "bf16 | bf16_full_eval"),
    ]
    wrong = []
    for path, wanted, name in pairs:
        found, value = _node(data, path)
        if not found or value is None or is_auto(value):
            continue
        same = list(value) == list(wanted) if isinstance(value, (list, tuple)) else value == wanted
        if not same:
            wrong.append(f"ds {path}={value!r} vs TrainingArguments {name}={wanted!r}")
    if wrong:
        raise XShardConfigError("these ds_config values disagree with the TrainingArguments (the Trainer requires "
                                f"them to match): {'; '.join(wrong)}. Set them to \"auto\" in the ds_config or make "
                                "them agree")


def _from_deepspeed(args: Any, given: dict[str, Any] | str, overrides: dict[str, Any],
                    env: Mapping[str, str]) -> XShardConfig:
    # read once, as a ds_config: --deepspeed says what it is (its keys are not asked)
    source = read_source(given, env, kind=ConfigKind.DEEPSPEED)
    data = source.deepspeed or {}
    if data.get("scheduler") is not None:
        kind = data["scheduler"].get("type") if isinstance(data["scheduler"], Mapping) else data["scheduler"]
        raise XShardConfigError(f"ds_config scheduler {kind!r}: DeepSpeed's schedulers are not implemented by "
                                f"xshard; {_FIX_SCHEDULER}", ("scheduler",))
    _check_optimizer(data, args)
    values = _script_values(args, env)
    _check_agreement(data, values)
    # train_batch_size "auto" needs the world size: always known here (the arguments set up the devices)
    return XShardConfig.load(source, overrides=overrides or None, env=env, script_args=values)


# ------------------------------------------------------------------------------------------ checks

# field -> (value that means "nothing asked", why xshard does not do it)
_UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "ddp_broadcast_buffers": ((None, True), "buffers are always broadcast from rank 0, as DDP's default does"),
    "ddp_static_graph": ((None, False), "nothing to declare: xshard's hooks follow the graph each step"),
    "save_on_each_node": ((False,), "one process writes each checkpoint (use a file system every node sees)"),
    "ddp_find_unused_parameters": ((None, False), "not needed: ranks whose batches skip units train at every "
                                                  "stage as DDP with it on"),
}


def _unhonoured(args: Any) -> list[str]:
    named = []
    for name, (quiet, why) in _UNHONOURED.items():
        value = getattr(args, name, None)
        if not any(value is q or value == q for q in quiet):
            named.append(f"{name}={value!r} ({why})")
    backend = getattr(args, "ddp_backend", None)
    if backend:
        named.append(f"ddp_backend={backend!r} (the backend XSHARD_BACKEND selects picks its collective library)")
    return named


def _refuse(args: Any) -> None:
    """Arguments that would change the results without a word: errors naming the argument and the fix."""
    for name, dtype in (("bf16_full_eval", "bf16"), ("fp16_full_eval", "fp16")):
        if getattr(args, name, False):
            raise XShardConfigError(
                f"{name}: the Trainer would cast the whole model to {dtype} in place for evaluation, and xshard does "
                f"not cast a sharded model's parameters; remove --{name} (--{dtype} evaluates in mixed precision)",
                (name,))
    parallelism = getattr(args, "parallelism_config", None)
    if parallelism is not None:
        sizes = {n: getattr(parallelism, n, 1) for n in ("tp_size", "cp_size", "sp_size", "dp_replicate_size")}
        if any((size or 1) > 1 for size in sizes.values()):
            raise XShardConfigError(
                f"parallelism_config ({', '.join(f'{k}={v}' for k, v in sizes.items() if (v or 1) > 1)}): xshard "
                "runs data parallel only, so each rank would see other batches than it does under tensor/context "
                "parallelism; remove parallelism_config (shard the model with --fsdp or --deepspeed stage 3)",
                ("parallelism_config",))


def _cache_key(args: Any) -> str | None:
    """What the config depends on, or None (no caching for arguments that are not xshard's)."""
    if not _is_xshards(args):
        return None
    names = ("deepspeed", "fsdp", "fsdp_config", "xshard_fsdp_words", "xshard_precision_fallback", "bf16", "fp16",
             "bf16_full_eval", "fp16_full_eval", "use_cpu", "per_device_train_batch_size",
             "gradient_accumulation_steps", "max_grad_norm", "learning_rate", "adam_beta1", "adam_beta2",
             "adam_epsilon", "weight_decay", "warmup_steps", "max_steps", "ddp_bucket_cap_mb", "ddp_backend",
             "ddp_broadcast_buffers", "ddp_static_graph", "save_on_each_node", "parallelism_config",
             "ddp_find_unused_parameters")
    return json.dumps({n: repr(getattr(args, n, None)) for n in names}, sort_keys=True)
