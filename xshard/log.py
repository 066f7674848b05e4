"""Logging for multi-process jobs: the main process talks, replicas only warn.

``setup_logging`` configures the ``xshard`` logger (and any logger obtained with ``get_logger``):

- the main process logs at INFO, every other process at WARNING, so N processes do not print the
  same line N times;
- ``XSHARD_LOG_LEVEL`` and ``XSHARD_LOG_LEVEL_REPLICA`` override those two levels (DEBUG, INFO,
  WARNING, ERROR, CRITICAL), arguments override the environment;
- ``log_on_each_node`` (or ``XSHARD_LOG_ON_EACH_NODE=1``) makes local rank 0 of every node a main
  process for logging, for jobs where each node's log is collected separately;
- lines of a multi-process job carry a ``[rank R/W]`` prefix.

``progress(iterable)`` (also ``xshard.tqdm``) is a tqdm bar shown by the main process only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")

_HANDLER_MARK = "_xshard_handler"
_managed: set[str] = {"xshard"}


@dataclass(frozen=True)
class LogPlan:
    """What ``setup_logging`` decided for this process (kept for tests and for ``progress``)."""

    level: int
    is_log_main: bool
    prefix: str


_current = LogPlan(level=logging.INFO, is_log_main=True, prefix="")


def parse_level(value: str | int, source: str) -> int:
    """A logging level from a name or a number; a clear error otherwise."""
    if isinstance(value, int):
        return value
    name = value.strip().upper()
    if name.isdigit():
        return int(name)
    if name not in LEVELS:
        raise ValueError(f"{source}={value!r} is not a log level; valid values are: {', '.join(LEVELS)}")
    return getattr(logging, name)


def parse_bool(value: str, source: str) -> bool:
    """Strict boolean parsing ("False" is false), with an error for anything else."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{source}={value!r} is not a boolean; use one of {', '.join(TRUE_WORDS + FALSE_WORDS[:-1])}")


def plan_logging(
    rank: int,
    local_rank: int,
    world_size: int,
    level: str | int | None = None,
    replica_level: str | int | None = None,
    log_on_each_node: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> LogPlan:
    """Decide this process's level and prefix (pure: no logger is touched)."""
    env = os.environ if env is None else env
    if log_on_each_node is None:
        raw = env.get("XSHARD_LOG_ON_EACH_NODE")
        log_on_each_node = parse_bool(raw, "XSHARD_LOG_ON_EACH_NODE") if raw is not None else False
    is_log_main = (local_rank == 0) if log_on_each_node else (rank == 0)
    if is_log_main:
        chosen = level if level is not None else env.get("XSHARD_LOG_LEVEL", "INFO")
        numeric = parse_level(chosen, "XSHARD_LOG_LEVEL" if level is None else "level")
    else:
        chosen = replica_level if replica_level is not None else env.get("XSHARD_LOG_LEVEL_REPLICA", "WARNING")
        numeric = parse_level(chosen, "XSHARD_LOG_LEVEL_REPLICA" if replica_level is None else "replica_level")
    prefix = f"[rank {rank}/{world_size}] " if world_size > 1 else ""
    return LogPlan(level=numeric, is_log_main=is_log_main, prefix=prefix)


def _apply(logger: logging.Logger, plan: LogPlan) -> None:
    logger.setLevel(plan.level)
    handler = next((h for h in logger.handlers if getattr(h, _HANDLER_MARK, False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        setattr(handler, _HANDLER_MARK, True)
        logger.addHandler(handler)
    handler.setFormatter(logging.Formatter(f"{plan.prefix}%(levelname)s %(name)s: %(message)s"))
    # Our handler prints the line; passing it on to the root logger as well would print it twice
    # when the user has configured logging.basicConfig.
    logger.propagate = False


def setup_logging(
    rank: int = 0,
    local_rank: int = 0,
    world_size: int = 1,
    level: str | int | None = None,
    replica_level: str | int | None = None,
    log_on_each_node: bool | None = None,
) -> LogPlan:
    """Configure xshard's loggers for this process (see the module docstring); returns the plan."""
    global _current
    _current = plan_logging(rank, local_rank, world_size, level, replica_level, log_on_each_node)
    for name in _managed:
        _apply(logging.getLogger(name), _current)
    return _current


def get_logger(name: str) -> logging.Logger:
    """A logger that follows xshard's per-process levels and rank prefix (call it from user code too)."""
    logger = logging.getLogger(name)
    if name == "xshard" or name.startswith("xshard."):
        return logger  # children of "xshard" inherit its level and handler
    _managed.add(name)
    _apply(logger, _current)
    return logger


def is_log_main_process() -> bool:
    """Does this process print main-process output (logs at the main level, progress bars)?"""
    return _current.is_log_main


def progress(iterable: Iterable[Any] | None = None, *, main_only: bool = True, **kwargs: Any) -> Any:
    """A tqdm progress bar drawn by the main process only, and only on a terminal.

    Only counts are shown: reading a device tensor inside the bar would force a sync (and, on
    XLA, a graph compile) every step.
    """
    from tqdm.auto import tqdm as _tqdm

    if main_only and not _current.is_log_main:
        kwargs["disable"] = True
    else:
        kwargs.setdefault("disable", None)  # tqdm's "only on a terminal": no bar lines in log files
    return _tqdm(iterable, **kwargs)


tqdm = progress
