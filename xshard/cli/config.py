"""Write a documented xshard config file (YAML with a comment per key).

  xshard config --stage 3 --mixed-precision bf16 > xshard.yaml
  xshard config --from ds_config.json --script-arg learning_rate=1e-6 --script-arg bf16=true -o xshard.yaml

Flags set single keys; --from converts a DeepSpeed, accelerate or HF fsdp_config file first (its
"auto" values need --script-arg NAME=VALUE with the HF TrainingArguments names). XSHARD_* environment
variables are not read here, so the file holds only what the flags and the converted file say.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import fields
from pathlib import Path

import yaml

from xshard.config import XShardConfig, XShardConfigError, XShardConfigWarning

_SKIPPED = {"optimizer", "scheduler"}  # nested sections: take them from a file with --from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config key, plus --from, --script-arg and --output."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--from", dest="from_file", metavar="FILE",
                        help="convert this config file (ds_config.json, accelerate yaml, fsdp_config json, xshard yaml)")
    parser.add_argument("--script-arg", dest="script_args", action="append", default=[], metavar="NAME=VALUE",
                        help="a training-script setting that fills 'auto' values in --from (e.g. learning_rate=1e-6)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of to standard output")
    keys = parser.add_argument_group("config keys")
    for f in fields(XShardConfig):
        if f.name in _SKIPPED:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            keys.add_argument(flag, dest=f"key_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                              help=f.metadata["help"])
        else:
            keys.add_argument(flag, dest=f"key_{f.name}", metavar="VALUE", default=None, help=f.metadata["help"])


def _script_args(items: list[str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise XShardConfigError(f"--script-arg {item!r}: expected NAME=VALUE, e.g. learning_rate=1e-6")
        try:  # JSON first: YAML reads 1e-6 as a string
            values[name.strip()] = json.loads(text)
        except ValueError:
            try:
                values[name.strip()] = yaml.safe_load(text)
            except yaml.YAMLError:
                values[name.strip()] = text
    return values


def run(args: argparse.Namespace) -> int:
    """Build the config from the flags (and --from), print or write its documented YAML."""
    overrides = {f.name: getattr(args, f"key_{f.name}") for f in fields(XShardConfig)
                 if getattr(args, f"key_{f.name}", None) is not None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XShardConfigWarning)
        config = XShardConfig.load(args.from_file, overrides=overrides, env={},
                                   script_args=_script_args(args.script_args))
    for warning in caught:
        print(f"xshard config: warning: {warning.message}", file=sys.stderr)
    text = config.to_yaml()
    if args.output:
        _write(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return 0


def _write(path: Path, text: str) -> None:
    """Write the file, or say in one line why it cannot be written and what to do."""
    if path.is_dir():
        raise XShardConfigError(f"-o {path} is a folder: give a file name, e.g. -o {path / 'xshard.yaml'}")
    if not path.parent.is_dir():
        raise XShardConfigError(f"-o {path}: the folder {path.parent} does not exist; create it first "
                                f"(mkdir -p {path.parent}) or write elsewhere")
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise XShardConfigError(f"-o {path}: cannot write the file ({exc.strerror or exc}); write elsewhere") from None
