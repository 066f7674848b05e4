"""Value parsing shared by `XShardConfig` and its file readers.

Every parser takes ``where`` (the key path the user wrote: ``zero_optimization.stage``,
``XSHARD_STAGE``, ``fsdp_config.fsdp_sharding_strategy``) so an error names the key, the value
and the valid choices. Strings are accepted wherever a file or an environment variable may hold
one ("true", "2", "2e8"); nothing else is coerced silently.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from xshard.errors import XShardError
from xshard.sharding.options import GROUP_SIZE_NAMES, strategy

#: sentinel for "use the framework's choice" in DeepSpeed and HF Trainer files
AUTO = "auto"


class XShardConfigError(XShardError, ValueError):
    """A config file, dict, environment variable or keyword holds an invalid value or contradictory keys.

    ``fields`` names the `XShardConfig` fields involved, so a loader can add where each was set.
    """

    one_line = True

    def __init__(self, message: str, fields: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


class XShardConfigWarning(UserWarning):
    """Keys that a config file sets but that have no effect in xshard (listed once per load)."""


def fail(where: str, value: Any, expected: str, fields: Iterable[str] = ()) -> XShardConfigError:
    """The error for ``where = value``: what was found and what is valid."""
    return XShardConfigError(f"{where}: {_show(value)} is not valid; expected {expected}", fields)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_TRUE = {"true", "yes", "on", "1", "y", "t"}
_FALSE = {"false", "no", "off", "0", "n", "f", "none", ""}


def parse_bool(where: str, value: Any) -> bool:
    """True/False, 0/1, or a string such as "true", "no", "1"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        key = value.strip().lower()
        if key in _TRUE:
            return True
        if key in _FALSE:
            return False
    raise fail(where, value, "true or false")


def _number(where: str, value: Any, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise fail(where, value, expected)
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise fail(where, value, expected) from None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range
        raise fail(where, value, expected) from None
    if not math.isfinite(number):
        beyond = " (a number too large to hold, such as 1e400, reads as infinity)" if math.isinf(number) else ""
        raise fail(where, value, expected + beyond)
    return number


#: the largest integer a setting may hold: what a 64-bit signed integer holds
MAX_INT = 2**63 - 1


#: the most processes a job may have (per node, nodes, in all): far above any cluster, so that a count this large
#: is a typo, refused before it sizes memory or processes (``xshard estimate`` makes estimates up to the same)
MAX_PROCESSES = 1 << 20


def parse_int(where: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              why: str = "") -> int:
    """An integer; JSON's ``2e8`` and strings like "8" are accepted when integral. ``maximum``: the largest
    accepted, ``why`` says what the bound is for (named in the error)."""
    if maximum is not None:
        expected = f"an integer in {minimum if minimum is not None else '...'}..{maximum:,}{why}"
    else:
        expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        real = _number(where, value, expected)
        if real != int(real):
            raise fail(where, value, expected)
        number = int(real)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise fail(where, value, expected)
    if number > MAX_INT:  # no counter holds it (a tensor, a C integer): a typo
        raise fail(where, value, f"{expected} and at most {MAX_INT}")
    return number


def parse_float(where: str, value: Any, minimum: float | None = None, strict: bool = False) -> float:
    """A finite number; ``strict`` makes ``minimum`` exclusive."""
    bound = "" if minimum is None else (f" > {minimum:g}" if strict else f" >= {minimum:g}")
    number = _number(where, value, f"a number{bound}")
    if minimum is not None and (number < minimum or (strict and number == minimum)):
        raise fail(where, value, f"a number{bound}")
    return number


def parse_choice(where: str, value: Any, choices: Mapping[str, str]) -> str:
    """One of ``choices`` (case-insensitive keys: spellings users write -> canonical value)."""
    canonical = list(dict.fromkeys(choices.values()))
    if isinstance(value, str) and value.strip().lower() in choices:
        return choices[value.strip().lower()]
    raise fail(where, value, "one of " + ", ".join(canonical))


_STAGE_EXPECTED = ("0, 1, 2, 3 or one of FULL_SHARD (3), SHARD_GRAD_OP (2), NO_SHARD (0), HYBRID_SHARD (3 within "
                   "each node), _HYBRID_SHARD_ZERO2 (2 within each node)")


def parse_strategy(where: str, value: Any) -> tuple[int, bool]:
    """(ZeRO stage 0-3, hybrid?) from an int, a digit string or a sharding strategy's name (the core's one
    table, ``xshard.sharding.options.STRATEGIES``); hybrid strategies (HYBRID_SHARD, _HYBRID_SHARD_ZERO2)
    shard within each node (shard_group_size: node)."""
    if isinstance(value, str):
        named = strategy(value)
        if named is not None:
            return named
    try:
        stage = parse_int(where, value)
    except XShardConfigError:
        raise fail(where, value, _STAGE_EXPECTED, ("stage",)) from None
    if stage not in (0, 1, 2, 3):
        raise fail(where, value, _STAGE_EXPECTED, ("stage",))
    return stage, False


def parse_stage(where: str, value: Any) -> int:
    """ZeRO stage 0-3 (a hybrid strategy name gives its stage; see ``read_strategy`` for the rest)."""
    return parse_strategy(where, value)[0]


def read_strategy(reading: Reading, where: str, value: Any) -> None:
    """Set ``stage`` from a sharding strategy, and ``shard_group_size: node`` for a hybrid one unless
    the file gives a size itself."""
    stage, hybrid = parse_strategy(where, value)
    reading.set("stage", stage, where)
    if hybrid and "shard_group_size" not in reading.values:
        reading.set("shard_group_size", "node", where)


def parse_group_size(where: str, value: Any) -> int | str | None:
    """``shard_group_size``: None (every rank in one group), "node" (LOCAL_WORLD_SIZE) or a positive int."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in GROUP_SIZE_NAMES:  # the core's one table of the words
        return GROUP_SIZE_NAMES[value.strip().lower()]
    expected = "null (every rank), 'node' (the processes of one node) or a positive number of ranks"
    try:
        return parse_int(where, value, 1)
    except XShardConfigError:
        raise fail(where, value, expected, ("shard_group_size",)) from None


def parse_reshard(where: str, value: Any) -> bool | int | None:
    """``reshard_after_forward``: None (the stage's default), true, false or a group size (an int >= 1)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "on", "off"):
        return parse_bool(where, value)
    try:
        return parse_int(where, value, 1)
    except XShardConfigError:
        raise fail(where, value, "true, false, null or a number of ranks to reshard to (a divisor of the shard "
                   "group size)", ("reshard_after_forward",)) from None


def parse_names(where: str, value: Any) -> list[str] | None:
    """A list of class names, from a list or a comma-separated string; None or empty means None."""
    if value is None:
        return None
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        items = [s.strip() for s in value]
    else:
        raise fail(where, value, "a list of class names or a comma-separated string (e.g. 'Qwen2DecoderLayer')")
    names = [s for s in items if s]
    if any(not s.replace("_", "").replace(".", "").isalnum() for s in names):
        raise fail(where, value, "class names such as 'Qwen2DecoderLayer' (letters, digits, '_' and '.')")
    return names or None


def is_auto(value: Any) -> bool:
    """The DeepSpeed / HF Trainer ``"auto"`` placeholder."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def is_json_like(value: Any, depth: int = 0) -> bool:
    """Plain data a YAML/JSON file can hold (no objects), nested at most 8 levels."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if depth >= 8:
        return False
    if isinstance(value, (list, tuple)):
        return all(is_json_like(v, depth + 1) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and is_json_like(v, depth + 1) for k, v in value.items())
    return False


#: optimizer / scheduler parameters that must be numbers (DeepSpeed's names; "betas" is a pair)
_FLOAT_PARAMS = {"lr", "weight_decay", "eps", "momentum", "dampening", "warmup_min_lr", "warmup_max_lr",
                 "warmup_min_ratio", "cos_min_ratio", "max_lr", "min_lr"}
_INT_PARAMS = {"warmup_num_steps", "total_num_steps", "last_batch_iteration"}


def parse_section(where: str, value: Any) -> dict[str, Any] | None:
    """An optimizer or scheduler section: ``{"type": "AdamW", "params": {...}}`` (params optional)."""
    if value is None:
        return None
    expected = 'a mapping {"type": NAME, "params": {...}}'
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str) or not value["type"].strip():
        raise fail(where, value, expected)
    params = value.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise fail(f"{where}.params", params, "a mapping of parameter names to values")
    clean: dict[str, Any] = {}
    for name, item in params.items():
        key = f"{where}.params.{name}"
        if not isinstance(name, str):
            raise fail(key, name, "a parameter name (string)")
        if name in _FLOAT_PARAMS:
            clean[name] = parse_float(key, item, 0.0)
        elif name in _INT_PARAMS:
            clean[name] = parse_int(key, item, 0)
        elif name == "betas":
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise fail(key, item, "two numbers [beta1, beta2] in [0, 1)")
            clean[name] = [parse_float(key, b, 0.0) for b in item]
            if any(b >= 1.0 for b in clean[name]):
                raise fail(key, item, "two numbers [beta1, beta2] in [0, 1)")
        elif is_auto(item):
            raise XShardConfigError(f"{key}: 'auto' has no value to take from the training script; write a value")
        elif is_json_like(item):
            clean[name] = item
        else:
            raise fail(key, item, "a number, string, boolean or list")
    return {"type": value["type"].strip(), "params": clean}


class Reading:
    """What a reader took from a file: field values, the key path that set each, keys with no effect."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values: dict[str, Any] = {}
        self.origin: dict[str, str] = {}
        self.ignored: list[str] = []

    def set(self, field: str, value: Any, key: str) -> None:
        """Set ``field`` from ``key``; two keys that set it differently contradict each other."""
        if field in self.values and self.values[field] != value:
            raise XShardConfigError(
                f"{key}={value!r} contradicts {self.origin[field]} (which sets {field} to "
                f"{self.values[field]!r}); keep one of them",
                (field,),
            )
        self.values[field] = value
        self.origin[field] = key

    def ignore(self, key: str) -> None:
        """Record a key that xshard does not act on (reported once, with all the others)."""
        if key not in self.ignored:
            self.ignored.append(key)


def harmless(value: Any, allowed: Iterable[Any]) -> bool:
    """``value`` is one of ``allowed`` (booleans compare as booleans, "auto" in any case)."""
    for ok in allowed:
        if ok == AUTO and is_auto(value):
            return True
        if isinstance(ok, bool) or isinstance(value, bool):
            if isinstance(ok, bool) and isinstance(value, bool) and ok is value:
                return True
        elif type(ok) is type(value) and ok == value:
            return True
        elif isinstance(ok, (int, float)) and isinstance(value, (int, float)) and ok == value:
            return True
    return False
