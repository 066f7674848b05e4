"""Render an `XShardConfig` as a documented YAML file (one comment per key), as `xshard config` writes it."""

from __future__ import annotations

import textwrap
from dataclasses import fields
from typing import Any

import yaml

HEADER = """\
# xshard configuration. Load it with xshard.Accelerator(config="xshard.yaml") or
# XShardConfig.load("xshard.yaml"). XSHARD_<KEY> environment variables (e.g. XSHARD_STAGE=2)
# override these values, and keyword overrides in code override both.
"""


def _value(name: str, value: Any) -> str:
    text = yaml.safe_dump({name: value}, default_flow_style=False, sort_keys=False, width=100)
    return text.rstrip("\n")


def render_yaml(config: Any) -> str:
    """The YAML text of ``config``: a header, then each field with its help text as a comment."""
    parts = [HEADER]
    for f in fields(config):
        comment = textwrap.wrap(f.metadata.get("help", ""), width=100, initial_indent="# ",
                                subsequent_indent="#   ")
        parts.append("\n".join(comment) + "\n" + _value(f.name, getattr(config, f.name)) + "\n")
    return "\n".join(parts)
