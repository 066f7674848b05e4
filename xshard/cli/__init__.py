"""The `xshard` command: `xshard launch | env | config | estimate | consolidate`.

Each subcommand lives in ``xshard/cli/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; it is imported only when used, so `xshard env` stays fast and a broken
optional dependency of one command cannot break the others. Errors meant for users
(``XShardError``) print one clear line and exit non-zero, never a traceback; so do errors of the
operating system (a path that does not exist, no permission, a full disk), with the fix named.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

COMMANDS: dict[str, str] = {
    "env": "show the backend xshard picks and why, devices, versions (--check runs a self-test)",
    "launch": "start a training script on N processes / nodes on any backend",
    "config": "write a documented xshard config file",
    "estimate": "estimate per-device memory for a model, world size and stage",
    "consolidate": "turn a sharded checkpoint into one state dict or a Hugging Face folder",
}


def _available() -> dict[str, str]:
    return {n: h for n, h in COMMANDS.items() if importlib.util.find_spec(f"xshard.cli.{n}") is not None}


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line naming the fix (not the usage block, then the error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="xshard", description="xshard: one training script, any accelerator.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in _available().items():
        module = importlib.import_module(f"xshard.cli.{name}")
        sp = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


#: a value that starts with a dash and a digit (``-5GB``, ``-1``, ``-.5``): argparse takes ``-5GB`` for an option
_DASH_VALUE = re.compile(r"^-\.?\d")


def attach_dash_values(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--device-memory -5GB`` as ``--device-memory=-5GB``: a subcommand's option that takes a value gets it even
    when it starts with a dash, so that the value's own check names the problem (argparse alone says "expected
    one argument"). Only the subcommand's options are read: the first positional argument (launch's script) and
    everything after it pass untouched."""
    argv = list(argv)
    commands = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if not argv or not isinstance(commands, dict) or argv[0] not in commands:
        return argv
    takes_value = {option for action in commands[argv[0]]._actions if action.option_strings and action.nargs is None
                   for option in action.option_strings}
    out, i = [argv[0]], 1
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):  # a positional argument: the rest is not ours to read
            return out + argv[i:]
        if token in takes_value and i + 1 < len(argv):
            value = argv[i + 1]
            out += [f"{token}={value}"] if _DASH_VALUE.match(value) else [token, value]
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def os_error_line(exc: OSError) -> str:
    """One line for an error of the operating system: the path, what went wrong, and the fix."""
    path = exc.filename if exc.filename is not None else ""
    reason = exc.strerror or str(exc)
    parent = os.path.dirname(os.path.abspath(path)) if path else ""
    if exc.errno == errno.ENOENT and parent and not os.path.isdir(parent):
        fix = f"the folder {parent} does not exist: create it first, or pick another path"
    elif exc.errno == errno.ENOENT:
        fix = "check the path"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "pick a path you may write to, or change its permissions"
    elif exc.errno == errno.EISDIR:
        fix = "it is a folder: give a file name"
    elif exc.errno == errno.ENOTDIR:
        fix = "a part of the path is a file, not a folder: fix the path"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space, or write somewhere else"
    else:
        fix = "check the path and try again"
    return f"{path}: {reason}; {fix}" if path else f"{reason}; {fix}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `xshard` console script and `python -m xshard`."""
    from xshard.cli.torch_import import TorchImportError, import_torch

    try:  # before anything imports torch: a broken device extension fails inside `import torch`
        import_torch()
    except TorchImportError as exc:
        print(f"xshard: error: {exc}", file=sys.stderr)
        return 2
    from xshard.errors import XShardError

    argv = list(sys.argv[1:] if argv is None else argv)
    # `launch` passes everything after the script through untouched: parse it without building
    # the other subcommands first (some import heavy optional packages).
    parser = build_parser()
    args, rest = parser.parse_known_args(attach_dash_values(argv, parser))
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    if rest and args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.script_args = [*getattr(args, "script_args", []), *rest]
    try:
        return int(args._run(args) or 0)
    except XShardError as exc:
        print(f"xshard {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"xshard {args.command}: error: {os_error_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
