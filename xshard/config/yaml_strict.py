"""YAML as config files need it: a key written twice in one mapping is an error, not "the last one wins".

PyYAML's ``safe_load`` keeps the second of two equal keys without a word, so a file with ``stage: 3``
and, further down, ``stage: 0`` silently runs stage 0. ``StrictLoader`` is ``SafeLoader`` (no Python
objects, no code) that refuses such a mapping naming the key and both lines; keys brought in by a
``<<`` merge may still be overridden, as YAML intends.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # an unhashable key: SafeLoader itself refuses it
                    continue
                if first != key_node.start_mark.line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (lines {first + 1} and {key_node.start_mark.line + 1}): "
                        "keep the one you mean", key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicated keys (``yaml.YAMLError`` naming the key and lines)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` that refuses a key given twice in one object."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice in one object: keep the one you mean")
        out[key] = value
    return out
