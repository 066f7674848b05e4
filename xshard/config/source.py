"""The one reader of a config source: its data, parsed once, and the record of what kind of config it is.

``read_config_source`` (public as ``xshard.config.read_source``, which knows xshard's own keys) takes what
``XShardConfig.load`` and ``xshard.Accelerator(config=...)`` take: None (then ``$XSHARD_CONFIG`` names the
file, if set), a path, a dict or an ``XShardConfig``. It returns a `ConfigSource`: the data, where it came
from, its `ConfigKind`, and ``deepspeed``, the DeepSpeed config that configures the job (a ds_config, or an
accelerate yaml with ``distributed_type: DEEPSPEED``; None otherwise).

Everything that needs the kind asks this record and never looks at the keys again: ``XShardConfig.load``
maps the data with that kind's reader, the Accelerator fills a ds_config's ``"auto"`` values and reports
``DistributedType.DEEPSPEED`` from ``deepspeed``, ``xshard launch`` reads an accelerate yaml's launch keys.
Where the user names the kind (the Trainer's ``--deepspeed``, Accelerate's ``DeepSpeedPlugin(hf_ds_config=)``)
it is passed as ``kind`` and not guessed.

How the kind is told from the keys (`detect_kind`), first match wins:

1. any of accelerate's keys (``distributed_type``, ``fsdp_config``, ``num_processes`` ...): an accelerate yaml;
2. a key only DeepSpeed's format has (``zero_optimization``, ``bf16``, ``fp16``, ... or an
   ``activation_checkpointing`` section): a ds_config, unless a key only xshard's format has (``stage``,
   ``mixed_precision``, ``offload_params`` ...) is there too: that is an error naming both readings and the
   fix, since the two readings shard differently (DeepSpeed has no top-level ``stage``: read as a ds_config,
   ``{"stage": 3, "bf16": {...}}`` would run ZeRO-0);
3. only ``fsdp_*`` keys and the HF Trainer's fsdp_config keys beside xshard's: an HF ``fsdp_config``;
4. otherwise xshard's own format. The keys both formats share (``train_micro_batch_size_per_gpu``,
   ``train_batch_size``, ``gradient_accumulation_steps``, ``gradient_clipping``, ``optimizer``,
   ``scheduler``) decide nothing: ``{"stage": 2, "train_micro_batch_size_per_gpu": 4}`` is an xshard config
   at stage 2 (every key is an xshard field), and ``{"train_batch_size": 16}`` alone is xshard's too (stage
   3 by default); add ``zero_optimization`` to have a file read as a ds_config.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from xshard.config.deepspeed import MARKERS as DEEPSPEED_MARKERS
from xshard.config.deepspeed import SHARED_KEYS as DEEPSPEED_SHARED_KEYS
from xshard.config.fsdp import ACCELERATE_MARKERS
from xshard.config.values import XShardConfigError, fail
from xshard.config.yaml_strict import load_yaml, unique_keys

__all__ = ["ConfigKind", "ConfigSource", "detect_kind", "parse_text", "read_bytes", "read_config_source"]


class ConfigKind(str, enum.Enum):
    """What a config source is."""

    DEFAULTS = "defaults"  # no source: the defaults (and XSHARD_* variables)
    # an XShardConfig object: xshard's own, whatever file it was loaded from (the Trainer passes its config so,
    # and plays the part it gives DDP: a --deepspeed run is not reported as DeepSpeed to the Trainer's loop)
    OBJECT = "XShardConfig"
    XSHARD = "xshard"  # xshard's own keys (what `xshard config` writes)
    DEEPSPEED = "deepspeed"  # a DeepSpeed ds_config
    ACCELERATE = "accelerate"  # an accelerate config yaml
    HF_FSDP = "hf_fsdp"  # the HF Trainer's fsdp_config


#: HF Trainer fsdp_config keys without the fsdp_ prefix
HF_FSDP_KEYS = frozenset({"xla", "xla_fsdp_settings", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "cpu_offload",
                          "reshard_after_forward", "version", "limit_all_gathers", "use_orig_params"})


@dataclass(frozen=True)
class ConfigSource:
    """A config source read once (see the module docstring).

    kind: what it is. name: the file's path, "config dict", "defaults" or "config object".
    data: the parsed mapping (None for defaults and objects). config: the XShardConfig given (kind OBJECT).
    base_dir: the folder relative paths inside it are read from (accelerate's ``deepspeed_config_file``).
    deepspeed: the DeepSpeed config that configures the job ("auto" values as written), or None.
    included: files the source names, already read (path as written -> data).
    """

    kind: ConfigKind
    name: str
    data: Mapping[str, Any] | None = None
    config: Any = None
    base_dir: Path = field(default_factory=Path.cwd)
    deepspeed: Mapping[str, Any] | None = None
    included: Mapping[str, Any] = field(default_factory=dict)

    @property
    def configured_by_deepspeed(self) -> bool:
        """The job is configured by DeepSpeed (Accelerate reports DistributedType.DEEPSPEED for it)."""
        return self.deepspeed is not None


def read_bytes(path: str | os.PathLike) -> bytes:
    """A config file's bytes; a missing or unreadable file is an XShardConfigError naming it."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise XShardConfigError(f"config file {os.fspath(path)!r} not found") from None
    except OSError as exc:
        raise XShardConfigError(f"config file {os.fspath(path)!r} cannot be read: {exc.strerror}") from None
    except ValueError as exc:  # e.g. a NUL character in the path
        raise XShardConfigError(f"config file {os.fspath(path)!r} is not a valid path: {exc}") from None


def parse_text(raw: bytes, source: str) -> Any:
    """The data in a config file's bytes: a ``.json`` file is JSON only; any other is JSON or YAML.

    JSON is tried first for YAML files too, since YAML 1.1 reads JSON's ``2e8`` as a string. Errors
    name the file, the line and the column (1-based, as editors count them).
    """
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise XShardConfigError(f"{source}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        if source.lower().endswith(".json"):
            raise XShardConfigError(_json_error(text, exc, source)) from None
    except (ValueError, RecursionError) as exc:
        if source.lower().endswith(".json"):
            raise XShardConfigError(f"{source}: not valid JSON ({exc})") from None
    try:
        return load_yaml(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(part for part in (exc.context, exc.problem) if part)
        raise XShardConfigError(f"{source}{where}: not valid YAML ({problem}); fix the file there") from None
    except (yaml.YAMLError, RecursionError, ValueError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise XShardConfigError(f"{source}: neither valid JSON nor valid YAML ({first})") from None


def _json_error(text: str, exc: json.JSONDecodeError, source: str) -> str:
    """One line: where the JSON error is, what it is, and the fix (a trailing comma is named as one)."""
    before = text[:exc.pos].rstrip()
    if before.endswith(",") and exc.msg.startswith(("Expecting property name", "Expecting value")):
        comma = len(before) - 1
        line = text.count("\n", 0, comma) + 1
        column = comma - (text.rfind("\n", 0, comma) + 1) + 1
        return (f"{source}, line {line}, column {column}: a trailing comma, which JSON does not allow; remove it "
                "(.json files are read as strict JSON)")
    return (f"{source}, line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg}); fix the file there "
            "(.json files are read as strict JSON)")


def detect_kind(data: Mapping[str, Any], name: str, native_keys: Set[str]) -> ConfigKind:
    """The kind of config ``data`` is (rules in the module docstring); ``native_keys``: xshard's own keys."""
    keys = set(data)
    if keys & ACCELERATE_MARKERS:
        return ConfigKind.ACCELERATE
    deepspeed_only = keys & DEEPSPEED_MARKERS
    if isinstance(data.get("activation_checkpointing"), Mapping):
        deepspeed_only.add("activation_checkpointing")  # DeepSpeed's section; xshard's is a boolean
    if deepspeed_only:
        xshard_only = keys & native_keys - DEEPSPEED_SHARED_KEYS
        if xshard_only:
            ours, theirs = ", ".join(sorted(xshard_only)), ", ".join(sorted(deepspeed_only))
            raise XShardConfigError(
                f"{name}: mixes keys of xshard's config ({ours}) with keys of a DeepSpeed ds_config ({theirs}), "
                f"and the two readings differ: as an xshard config the DeepSpeed keys are unknown; as a ds_config "
                f"{ours} would be ignored (DeepSpeed reads the stage from zero_optimization.stage, ZeRO-0 when "
                "absent). Write one format: move the settings into their DeepSpeed keys (e.g. stage -> "
                "zero_optimization.stage), or drop the DeepSpeed keys and use xshard's (`xshard config --from "
                "ds_config.json` converts a ds_config)")
        return ConfigKind.DEEPSPEED
    if not keys <= native_keys and all(k.startswith("fsdp_") or k in HF_FSDP_KEYS for k in keys - native_keys):
        return ConfigKind.HF_FSDP
    return ConfigKind.XSHARD


def _as_mapping(data: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise XShardConfigError(f"{name}: a config must be a mapping of keys to values, not {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise fail(name, bad[0], "string keys only")
    return data


def _accelerate_deepspeed(data: Mapping[str, Any], name: str, base_dir: Path
                          ) -> tuple[Mapping[str, Any] | None, dict[str, Any]]:
    """An accelerate yaml's DeepSpeed config (None unless ``distributed_type: DEEPSPEED``) and the
    ``deepspeed_config_file`` it names, read (the accelerate reader checks the section's values)."""
    kind = data.get("distributed_type")
    if not (isinstance(kind, str) and kind.strip().upper() == "DEEPSPEED"):
        return None, {}
    section = data.get("deepspeed_config") or {}
    if not isinstance(section, Mapping):
        return {}, {}
    inner = section.get("deepspeed_config_file")
    if isinstance(inner, str) and inner:
        path = os.fspath(base_dir / inner)
        try:
            included = parse_text(read_bytes(path), path)
        except XShardConfigError as exc:
            raise XShardConfigError(f"{name}: {exc}", exc.fields) from None
        deepspeed = dict(included) if isinstance(included, Mapping) else {}
        return deepspeed, {inner: included}
    return {"zero_optimization": {"stage": section.get("zero_stage", 2)}}, {}  # accelerate's default: ZeRO-2


def read_config_source(source: Any, env: Mapping[str, str], native_keys: Set[str],
                       kind: ConfigKind | None = None) -> ConfigSource:
    """Read ``source`` (None, a path or a mapping) once into a `ConfigSource` (see the module docstring);
    ``kind``, when given, is taken as it is. An XShardConfig object is `xshard.config.read_source`'s to wrap."""
    if isinstance(source, ConfigSource):
        return source
    if source is None and env.get("XSHARD_CONFIG"):
        source = env["XSHARD_CONFIG"]
    if source is None:
        return ConfigSource(ConfigKind.DEFAULTS, "defaults")
    if isinstance(source, Mapping):
        name, base_dir, data = "config dict", Path.cwd(), source
    elif isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        data = parse_text(read_bytes(source), name)
        base_dir = Path(source).resolve().parent
    else:
        raise fail("source", source, "None, a file path, a dict or an XShardConfig")
    data = _as_mapping(data, name)
    kind = detect_kind(data, name, native_keys) if kind is None else ConfigKind(kind)
    deepspeed: Mapping[str, Any] | None = None
    included: dict[str, Any] = {}
    if kind is ConfigKind.DEEPSPEED:
        deepspeed = data
    elif kind is ConfigKind.ACCELERATE:
        deepspeed, included = _accelerate_deepspeed(data, name, base_dir)
    return ConfigSource(kind, name, data=data, base_dir=base_dir, deepspeed=deepspeed, included=included)
