"""`XShardConfig`: one validated configuration, read from the files users already have.

Load it with ``XShardConfig.load(source, overrides=None, env=os.environ, script_args=None)``:

- ``source``: None (then ``$XSHARD_CONFIG`` names the file, if set), a path to a YAML or JSON file,
  a dict, an `XShardConfig`, or a `ConfigSource` already read (``read_source``). The file is read once
  and its kind told from its keys by `xshard.config.source` (or given as ``kind=``):

  * xshard's own format (the keys are the field names below; ``xshard config`` writes one),
  * a DeepSpeed ``ds_config.json`` (see `xshard.config.deepspeed`; ``"auto"`` values are filled from
    ``script_args`` as the HF Trainer does, see `xshard.config.auto`),
  * an accelerate config yaml (``distributed_type: FSDP`` + ``fsdp_config``; see `xshard.config.fsdp`),
  * an HF Trainer ``fsdp_config`` json (for the ``--fsdp`` words use `XShardConfig.from_hf_fsdp`).

- Precedence, highest first: keyword ``overrides`` > ``XSHARD_*`` environment variables (one per field:
  ``XSHARD_STAGE=2``, ``XSHARD_MIXED_PRECISION=bf16``, ``XSHARD_TRANSFORMER_LAYER_CLS_TO_WRAP=A,B``,
  ``XSHARD_OPTIMIZER='{"type": "AdamW", "params": {"lr": 1e-5}}'``...) > the config file > defaults.

Keys a file sets that have no effect in xshard are named in ONE `XShardConfigWarning` per load. Invalid
values, malformed files and contradictory keys raise `XShardConfigError`, naming the key path, the
value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from xshard.backends import NAMES as BUILTIN_BACKENDS
from xshard.backends import names as backend_names
from xshard.config.auto import ScriptArgs, resolve_auto
from xshard.config.deepspeed import read_deepspeed
from xshard.config.fsdp import STATE_DICT, WRAP, read_accelerate, read_hf_fsdp
from xshard.config.precision_names import parse_dtype, parse_mixed_precision, torch_dtype
from xshard.config.source import ConfigKind, ConfigSource, parse_text, read_bytes, read_config_source
from xshard.config.values import (
    MAX_PROCESSES,
    Reading,
    XShardConfigError,
    XShardConfigWarning,
    fail,
    is_auto,
    parse_bool,
    parse_choice,
    parse_float,
    parse_group_size,
    parse_int,
    parse_names,
    parse_reshard,
    parse_section,
    parse_stage,
    parse_strategy,
)
from xshard.sharding.options import BACKWARD_PREFETCH_NAMES, ShardingOptions, ShardingOptionsError

if TYPE_CHECKING:
    import torch

__all__ = ["XShardConfig", "XShardConfigError", "XShardConfigWarning"]

ENV_PREFIX = "XSHARD_"
ALIASES = {"xla_fsdp_grad_ckpt": "activation_checkpointing"}
LOG_LEVELS = {name: name for name in ("debug", "info", "warning", "error", "critical")}


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class XShardConfig:
    """How xshard shards, casts, offloads and steps a training run (validated on construction)."""

    stage: int = _opt(3, "ZeRO stage: 0 replicate (DDP), 1 + optimizer state sharded, 2 + gradients sharded "
                         "(SHARD_GRAD_OP), 3 + parameters sharded (FULL_SHARD). FSDP names accepted.")
    shard_group_size: int | str | None = _opt(
        None, "hybrid sharding: shard within groups of this many consecutive ranks and replicate across the "
              "groups (all-gathers and reduce-scatters inside a group, one all-reduce of the reduced shards "
              "across groups); 'node': the processes of one node (LOCAL_WORLD_SIZE, which xshard launch "
              "--nproc sets per node); null: every rank in one group. HYBRID_SHARD / _HYBRID_SHARD_ZERO2 as "
              "the stage mean 3 / 2 with 'node'; DeepSpeed's mics_shard_size sets it")
    reshard_after_forward: bool | int | None = _opt(
        None, "FSDP2's: free each unit's full parameters after forward (true, stage 3's default) or keep them "
              "(false, stages 1-2); an int k keeps 1/k per rank so backward gathers within groups of k ranks "
              "(a node; DeepSpeed's zero_hpz_partition_size); null: the stage's default")
    auto_wrap_policy: str = _opt("transformer", "how the model splits into units gathered one at a time: "
                                                "transformer (by block class), size (by min_num_params), none")
    transformer_layer_cls_to_wrap: list[str] | None = _opt(
        None, "block class names for 'transformer' (null: the model's _no_split_modules)")
    min_num_params: int = _opt(100_000_000, "parameters per unit for the 'size' policy")
    backward_prefetch: str = _opt("pre", "gather the next unit in backward: pre (before this unit's "
                                         "gradients), post (after), none")
    forward_prefetch: bool = _opt(True, "gather the next unit before this unit's forward runs")
    max_inflight_all_gathers: int = _opt(2, "units gathered at once (current + prefetched)")
    mixed_precision: str = _opt("no", "compute dtype: no (fp32), bf16 or fp16; master weights stay fp32")
    reduce_dtype: str | None = _opt(None, "gradient reduce dtype: fp32, bf16, fp16 (null: the compute dtype at stages 1-3, "
                                      "the gradient's own at stage 0, as DDP)")
    keep_norms_fp32: bool = _opt(False, "norm layers compute in fp32 under mixed precision")
    offload_params: bool = _opt(False, "keep parameter and gradient shards in host memory")
    offload_optimizer: bool = _opt(False, "keep optimizer state in host memory (the optimizer steps on the CPU)")
    activation_checkpointing: bool = _opt(False, "recompute each unit's activations in backward "
                                                 "(alias: xla_fsdp_grad_ckpt)")
    state_dict_type: str = _opt("full", "checkpoints: full (one plain model.safetensors), sharded (model rows per "
                                        "rank, no gather): both resume on any world size and stage; local "
                                        "(optimizer as saved per rank): same world size and stage only")
    async_save: bool = _opt(False, "save_state copies this rank's state to host memory and writes it in the "
                                   "background (the next save, load_state and end wait for it)")
    sync_module_states: bool = _opt(False, "broadcast rank 0's parameters and buffers before sharding")
    bucket_size_mb: float = _opt(25.0, "all-reduce bucket size at stage 0, in MiB")
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    gradient_clipping: float | None = _opt(None, "max global gradient norm (null or 0: no clipping)")
    train_micro_batch_size_per_gpu: int | None = _opt(None, "samples per device per micro-batch")
    train_batch_size: int | None = _opt(None, "samples per optimizer step over all devices "
                                              "(checked: micro x accumulation x world size)")
    optimizer: dict[str, Any] | None = _opt(None, 'optimizer for the script: {type: AdamW, params: {lr: ...}}')
    scheduler: dict[str, Any] | None = _opt(None, "scheduler for the script: {type: WarmupDecayLR, params: ...}")
    backend: str = _opt("auto", f"hardware: {', '.join(BUILTIN_BACKENDS)}, or a registered backend's name")
    devices: int | None = _opt(None, "processes per node (null: one per visible device)")
    num_nodes: int = _opt(1, "number of nodes")
    seed: int | None = _opt(None, "random seed for every process (null: do not seed)")
    static_shape_multiple: int = _opt(64, "on backends that compile whole graphs (XLA): token batches are padded "
                                          "to a multiple of this width, so there are few shapes to compile "
                                          "(0: off)")
    generate_gathers_once: bool | str = _opt(
        "auto", "generate() at stage 3: gather the whole model once for the call (true; memory: the whole model "
                "in the compute dtype on every rank), every unit at every decoding step (false), or once when "
                "the whole model fits in the device's free memory (auto)")
    timeout: float = _opt(1800.0, "seconds a collective may wait for the other ranks before the job stops with a "
                                  "message naming the ranks that never arrived (XSHARD_TIMEOUT)")
    log_level: str = _opt("info", "debug, info, warning, error or critical")

    def __post_init__(self) -> None:
        stage, hybrid = parse_strategy("stage", self.stage)  # HYBRID_SHARD: a stage and a group size
        if hybrid and self.shard_group_size is None:
            self.shard_group_size = "node"
        self.stage = stage
        for f in fields(self):
            setattr(self, f.name, _normalise(f.name, getattr(self, f.name)))
        self._check_consistency()

    def _check_consistency(self) -> None:
        # the rules between sharding options (stage 0 with offload or hybrid groups ...) are the core's, checked
        # in one place: ShardingOptions.validate, which building the options runs
        try:
            self.to_sharding_options()
        except ShardingOptionsError as exc:
            raise XShardConfigError(str(exc), exc.fields) from None
        if self.devices is not None and self.train_batch_size is not None and self.train_micro_batch_size_per_gpu:
            world = self.devices * self.num_nodes
            expected = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps * world
            if self.train_batch_size != expected:
                raise XShardConfigError(
                    f"train_batch_size={self.train_batch_size} != train_micro_batch_size_per_gpu="
                    f"{self.train_micro_batch_size_per_gpu} x gradient_accumulation_steps="
                    f"{self.gradient_accumulation_steps} x world size {world} (= {expected}); fix one of them",
                    ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "devices"))

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, source: str | os.PathLike | Mapping[str, Any] | XShardConfig | ConfigSource | None = None,
             overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
             script_args: Any = None, kind: ConfigKind | None = None) -> XShardConfig:
        """Build a config from ``source`` + ``XSHARD_*`` env + ``overrides`` (see the module docstring).

        ``source`` may be a `ConfigSource` already read (``read_source``); ``kind`` says what the file is
        (e.g. ``ConfigKind.DEEPSPEED`` for a path the user gave as a ds_config) instead of telling it from
        its keys."""
        env = os.environ if env is None else env
        read = read_source(source, env, kind)
        return cls._build(_reading(read, script_args, env), overrides, env)

    @classmethod
    def from_hf_fsdp(cls, fsdp: str | list[str] | bool, fsdp_config: Mapping[str, Any] | str | None = None,
                     overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
                     ) -> XShardConfig:
        """From the HF Trainer's ``--fsdp "full_shard auto_wrap offload"`` and its ``fsdp_config``."""
        source = "fsdp_config"
        config: Mapping[str, Any] | None
        if isinstance(fsdp_config, (str, os.PathLike)):
            source = str(fsdp_config)
            config = parse_text(read_bytes(fsdp_config), source)
        else:
            config = fsdp_config
        reading = _guard(source, lambda: read_hf_fsdp(fsdp, config, Reading(source)))
        return cls._build(reading, overrides, os.environ if env is None else env)

    @classmethod
    def _build(cls, reading: Reading, overrides: Mapping[str, Any] | None, env: Mapping[str, str]) -> XShardConfig:
        values, origin = dict(reading.values), {k: f"{v} in {reading.source}" for k, v in reading.origin.items()}
        for name, value in env_values(env).items():
            values[name], origin[name] = value, ENV_PREFIX + name.upper()
        if overrides is not None:
            if not isinstance(overrides, Mapping):
                raise fail("overrides", overrides, "a mapping of field names to values")
            for key, value in overrides.items():
                name = field_name(key, "overrides")
                values[name], origin[name] = value, f"overrides[{key!r}]"
        try:
            config = cls(**values)
        except XShardConfigError as exc:
            where = [f"{name} from {origin[name]}" for name in exc.fields if name in origin]
            if not where:
                raise
            raise XShardConfigError(f"{exc} [set by: {'; '.join(where)}]", exc.fields) from None
        # One warning, after the config proved valid, and from one process: every rank of a job reads
        # the same file (torchrun's RANK; a process outside a job has none and warns).
        if reading.ignored and env.get("RANK", "0") == "0":
            warnings.warn(
                f"{reading.source}: these keys have no effect in xshard and are ignored: "
                f"{', '.join(reading.ignored)}", XShardConfigWarning, stacklevel=3)
        return config

    # ------------------------------------------------------------------ output

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain data (what the xshard YAML format holds)."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """A documented YAML file (a comment per key) that `load` reads back to this config."""
        from xshard.config.render import render_yaml

        return render_yaml(self)

    def to_sharding_options(self, *, world_size: int = 1, output_dtype: torch.dtype | None = None,
                            weights_from_checkpoint: bool = False) -> ShardingOptions:
        """The sharded core's `xshard.sharding.ShardingOptions` for this config on a job of ``world_size``
        processes, built whole (nothing changes them afterwards).

        - ``output_dtype``: the job's precision casts floating outputs of the model's forward to it (fp32
          under mixed precision, as Accelerate returns them); it applies only with a compute dtype.
        - ``world_size`` > 1 broadcasts rank 0's initial weights (``sync_module_states``), as DDP does at
          construction: seeds alone do not make ranks agree where replicas share one process (XLA:CPU's
          replica threads draw from one generator) or a script seeds per rank. Not when
          ``weights_from_checkpoint``: a model whose parameters are still on the meta device (loaded shard by
          shard) is filled from its checkpoint on every rank instead. One built under ``sharded_init`` has
          its values recorded, so rank 0 rebuilds and broadcasts them one parameter at a time.
        """
        param_dtype = torch_dtype(self.mixed_precision)
        broadcast = world_size > 1 and not weights_from_checkpoint
        return ShardingOptions(
            stage=self.stage, shard_group_size=self.shard_group_size,
            reshard_after_forward=self.reshard_after_forward, auto_wrap_policy=self.auto_wrap_policy,
            transformer_layer_cls_to_wrap=list(self.transformer_layer_cls_to_wrap or []) or None,
            min_num_params=self.min_num_params, backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch, max_inflight_all_gathers=self.max_inflight_all_gathers,
            param_dtype=param_dtype, reduce_dtype=torch_dtype(self.reduce_dtype), buffer_dtype=None,
            output_dtype=output_dtype if param_dtype is not None else None, keep_norms_fp32=self.keep_norms_fp32,
            offload_params=self.offload_params, offload_optimizer=self.offload_optimizer,
            activation_checkpointing=self.activation_checkpointing,
            sync_module_states=self.sync_module_states or broadcast, bucket_size_mb=self.bucket_size_mb,
            generate_gathers_once=None if self.generate_gathers_once == "auto" else bool(self.generate_gathers_once),
        )


# ---------------------------------------------------------------------- field values

FIELD_NAMES = tuple(f.name for f in fields(XShardConfig))
#: the keys of xshard's own format (what `xshard.config.source` tells it by)
NATIVE_KEYS = frozenset(FIELD_NAMES) | frozenset(ALIASES)
_OPTIONAL = {"shard_group_size", "reshard_after_forward", "transformer_layer_cls_to_wrap", "reduce_dtype", "gradient_clipping", "train_micro_batch_size_per_gpu",
             "train_batch_size", "optimizer", "scheduler", "devices", "seed"}


def _normalise(name: str, value: Any) -> Any:
    """The canonical value of field ``name`` (raises XShardConfigError naming it)."""
    try:
        return _NORMALISERS[name](name, value)
    except XShardConfigError as exc:
        raise XShardConfigError(str(exc), exc.fields or (name,)) from None


def _optional(parse: Any) -> Any:
    return lambda where, value: None if value is None else parse(where, value)


def _choice(choices: Mapping[str, str], none: str | None = None) -> Any:
    def parse(where: str, value: Any) -> str:
        if value is None and none is not None:
            return none
        if value is False and none is not None:  # YAML reads an unquoted `no` as false
            return none
        return parse_choice(where, value, choices)
    return parse


def _positive(where: str, value: Any) -> int:
    return parse_int(where, value, 1)


def _bounded(minimum: int, maximum: int, why: str) -> Callable[[str, Any], int]:
    """A count that sizes memory or processes: at most ``maximum`` (``why`` names what it sizes)."""
    return lambda where, value: parse_int(where, value, minimum, maximum, f" ({why})")


#: units gathered at once: each holds its unit's full parameters on the device, and past a few the next unit's
#: gather is long done before its compute (FSDP's own limit is 2)
MAX_INFLIGHT_ALL_GATHERS = 64
_PROCESSES = _bounded(1, MAX_PROCESSES, "processes: more would be more than any job runs")


def _auto_or_bool(where: str, value: Any) -> bool | str:
    """"auto", or true/false in any of parse_bool's spellings."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(where, value)
    except XShardConfigError:
        raise fail(where, value, "auto, true or false") from None


_NORMALISERS: dict[str, Any] = {
    "stage": parse_stage,
    "shard_group_size": parse_group_size,
    "reshard_after_forward": parse_reshard,
    "auto_wrap_policy": _choice(WRAP, none="none"),
    "transformer_layer_cls_to_wrap": parse_names,
    "min_num_params": _positive,
    "backward_prefetch": _choice(BACKWARD_PREFETCH_NAMES, none="none"),
    "max_inflight_all_gathers": _bounded(1, MAX_INFLIGHT_ALL_GATHERS, "each unit in flight holds its full "
                                        "parameters on the device"),
    "mixed_precision": parse_mixed_precision,
    "reduce_dtype": parse_dtype,
    "state_dict_type": _choice(STATE_DICT),
    "bucket_size_mb": lambda w, v: parse_float(w, v, 0.0, strict=True),
    "timeout": lambda w, v: parse_float(w, v, 0.0, strict=True),
    "static_shape_multiple": _bounded(0, 1 << 20, "tokens a batch is padded to a multiple of"),
    "gradient_accumulation_steps": _positive,
    "gradient_clipping": lambda w, v: None if v is None else (parse_float(w, v, 0.0) or None),
    "train_micro_batch_size_per_gpu": _optional(_positive),
    "train_batch_size": _optional(_positive),
    "optimizer": parse_section,
    "scheduler": parse_section,
    # asked at validation time: backends registered after import (register_backend) count too
    "backend": lambda w, v: parse_choice(w, v, {name: name for name in backend_names()}),
    "devices": lambda w, v: None if v is None or is_auto(v) else _PROCESSES(w, v),
    "num_nodes": _PROCESSES,
    "seed": _optional(lambda w, v: parse_int(w, v, 0)),
    "log_level": _choice(LOG_LEVELS),
    "generate_gathers_once": _auto_or_bool,
}
for _name in ("forward_prefetch", "keep_norms_fp32", "offload_params", "offload_optimizer",
              "activation_checkpointing", "sync_module_states", "async_save"):
    _NORMALISERS[_name] = parse_bool
assert set(_NORMALISERS) == set(FIELD_NAMES), "every field needs a normaliser"


def field_name(key: Any, where: str) -> str:
    """The field a key names (aliases resolved); unknown keys are an error with a suggestion."""
    if isinstance(key, str) and key in ALIASES:
        return ALIASES[key]
    if isinstance(key, str) and key in FIELD_NAMES:
        return key
    close = difflib.get_close_matches(str(key), [*FIELD_NAMES, *ALIASES], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise XShardConfigError(f"{where}: unknown key {key!r}{hint} Valid keys: {', '.join(FIELD_NAMES)}")


def env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """Field values from ``XSHARD_<FIELD>`` variables, validated (errors name the variable)."""
    values: dict[str, Any] = {}
    for name in FIELD_NAMES:
        var = ENV_PREFIX + name.upper()
        if var not in env:
            continue
        text = env[var]
        if name == "stage" and parse_strategy(var, text)[1] and ENV_PREFIX + "SHARD_GROUP_SIZE" not in env:
            values["shard_group_size"] = "node"  # XSHARD_STAGE=HYBRID_SHARD
        if name in _OPTIONAL and text.strip().lower() in ("", "none", "null"):
            value: Any = None
        elif name in ("optimizer", "scheduler"):
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                raise fail(var, text, 'JSON such as {"type": "AdamW", "params": {"lr": 1e-5}}') from None
        else:
            value = text
        try:
            values[name] = _normalise(name, value)
        except XShardConfigError as exc:
            raise XShardConfigError(str(exc).replace(f"{name}:", f"{var}:", 1), exc.fields) from None
    return values


# ---------------------------------------------------------------------- reading files


def read_source(source: Any = None, env: Mapping[str, str] | None = None,
                kind: ConfigKind | None = None) -> ConfigSource:
    """Read a config source once: its data and what kind of config it is (`xshard.config.source`)."""
    if isinstance(source, XShardConfig):
        return ConfigSource(ConfigKind.OBJECT, "config object", config=source)
    return read_config_source(source, os.environ if env is None else env, NATIVE_KEYS, kind)


def read_file(path: str | os.PathLike, script_args: Any = None, env: Mapping[str, str] | None = None) -> Reading:
    """Read any supported config file into a `Reading`."""
    env = env or {}
    return _reading(read_source(os.fspath(path), env), script_args, env)


_Read = TypeVar("_Read")


def _guard(source: str, read: Callable[[], _Read]) -> _Read:
    try:
        return read()
    except XShardConfigError as exc:
        raise XShardConfigError(f"{source}: {exc}", exc.fields) from None


def _reading(source: ConfigSource, script_args: Any, env: Mapping[str, str]) -> Reading:
    """Map ``source`` onto `XShardConfig` fields with the reader of its kind."""
    reading = Reading(source.name)
    if source.kind is ConfigKind.DEFAULTS:
        return reading
    if source.kind is ConfigKind.OBJECT:
        for name, value in source.config.to_dict().items():
            reading.set(name, value, name)
        return reading
    data = source.data if source.data is not None else {}
    world = ScriptArgs(script_args, env).world_size()

    def resolve() -> dict[str, Any]:
        return resolve_auto(data, script_args, env)

    def read_ds_file(path: str, key: str) -> None:
        # accelerate's deepspeed_config_file, read with the source: always a DeepSpeed config (never recursively)
        inner_data = source.included[path]
        if not isinstance(inner_data, Mapping) or not all(isinstance(k, str) for k in inner_data):
            raise XShardConfigError(f"{key}: {path!r} does not hold a DeepSpeed config (a JSON object)")
        inner = _guard(path, lambda: read_deepspeed(resolve_auto(inner_data, script_args, env),
                                                    Reading(path), world))
        for field_, value in inner.values.items():
            reading.set(field_, value, f"{inner.origin[field_]} in {path} ({key})")
        for ignored in inner.ignored:
            reading.ignore(f"{path}:{ignored}")

    if source.kind is ConfigKind.ACCELERATE:
        return _guard(source.name, lambda: read_accelerate(data, reading, read_ds_file))
    if source.kind is ConfigKind.DEEPSPEED:
        return _guard(source.name, lambda: read_deepspeed(resolve(), reading, world))
    if source.kind is ConfigKind.HF_FSDP:
        return _guard(source.name, lambda: read_hf_fsdp(True, data, reading))
    resolved = _guard(source.name, resolve)
    for key, value in resolved.items():
        reading.set(field_name(key, source.name), value, key)
    return reading
