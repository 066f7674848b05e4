"""Logging for multi-process jobs: the main process talks, replicas only warn.

``setup_logging`` configures the ``xshard`` logger (and any logger obtained with ``get_logger``):

- the main process logs at INFO, every other process at WARNING, so N processes do not print the
  same line N times;
- ``XSHARD_LOG_LEVEL`` and ``XSHARD_LOG_LEVEL_REPLICA`` override those two levels (DEBUG, INFO,
  WARNING, ERROR, CRITICAL), arguments override the environment;
- ``log_on_each_node`` (or ``XSHARD_LOG_ON_EACH_NODE=1``) makes local rank 0 of every node a main
  process for logging, for jobs where each node's log is collected separately;
- lines of a multi-process job carry a ``[rank R/W]`` prefix.

``get_logger(name)`` (also ``xshard.get_logger`` and ``xshard.logging.get_logger``) takes
Accelerate's keywords on every call: ``main_process_only=True`` logs on the main process only,
``main_process_only=False`` on every process at the main process's level, ``in_order=True`` on
every process one after the other in rank order. Without them the per-process levels above apply
(replicas show warnings), where Accelerate's logger would log on the main process only.

``progress(iterable)`` (also ``xshard.tqdm``) is a tqdm bar shown by the main process only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

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
    #: the main process's level: what ``main_process_only=False`` and ``in_order`` log at everywhere
    main_level: int = logging.INFO
    rank: int = 0
    world_size: int = 1


class LoggingJob(Protocol):
    """What ``in_order`` logging asks of the job it logs for (``xshard.runtime.job.JobState`` is one)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def barrier(self) -> None: ...


_current = LogPlan(level=logging.INFO, is_log_main=True, prefix="")
#: The job this process's loggers log for (``log_for_job``): ``in_order`` logging takes turns in its ranks, at
#: its barrier. Design note: one holder per process, not a job per logger, because Accelerate's
#: ``get_logger(name)`` (and ``logging.getLogger``) takes no job: a logger made anywhere in a script, before or
#: after the Accelerator, logs for the process's job. The Accelerator sets it once its job runs and takes it back
#: when the job ends; None: no job (each process logs on its own, no waiting).
_job: LoggingJob | None = None
#: levels given to ``get_logger(name, log_level=...)``, kept over later ``setup_logging`` calls
_explicit_levels: dict[str, int] = {}


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
    chosen = level if level is not None else env.get("XSHARD_LOG_LEVEL", "INFO")
    main_level = parse_level(chosen, "XSHARD_LOG_LEVEL" if level is None else "level")
    if is_log_main:
        numeric = main_level
    else:
        chosen = replica_level if replica_level is not None else env.get("XSHARD_LOG_LEVEL_REPLICA", "WARNING")
        numeric = parse_level(chosen, "XSHARD_LOG_LEVEL_REPLICA" if replica_level is None else "replica_level")
    prefix = f"[rank {rank}/{world_size}] " if world_size > 1 else ""
    return LogPlan(level=numeric, is_log_main=is_log_main, prefix=prefix, main_level=main_level, rank=rank,
                   world_size=world_size)


def _apply(logger: logging.Logger, plan: LogPlan) -> None:
    logger.setLevel(_explicit_levels.get(logger.name, plan.level))
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


def log_for_job(job: LoggingJob | None) -> None:
    """Log for ``job`` from now on: ``in_order`` takes turns in its ranks at its barrier (set by the Accelerator
    once its job runs; None when it ends: no job, no waiting)."""
    global _job
    _job = job


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger for multi-process jobs that takes Accelerate's ``main_process_only`` and ``in_order``
    keywords on every call (see the module docstring); otherwise a ``logging.Logger``'s methods."""

    # Accelerate's keywords beside LoggerAdapter's own (exc_info, stacklevel ... pass through **kwargs)
    def log(self, level: int, msg: object, *args: Any, main_process_only: bool | None = None,  # type: ignore[override]
            in_order: bool = False, **kwargs: Any) -> None:
        """Log ``msg``: on this process's level (default), the main process only, or every process."""
        kwargs.setdefault("stacklevel", 2)
        plan = _current
        if not in_order and main_process_only is None:
            self.logger.log(level, msg, *args, **kwargs)
            return
        if not in_order and main_process_only:
            if plan.is_log_main:
                self.logger.log(level, msg, *args, **kwargs)
            return
        # every process, at the main process's level (replicas' own level would hide the line), unless
        # this logger was given another level (get_logger(name, log_level=...), setLevel)
        own = self.logger.getEffectiveLevel()
        wanted = level >= (plan.main_level if own == plan.level else own)
        if not in_order:
            if wanted:
                self._emit(level, msg, args, kwargs)
            return
        job = _job
        if job is None:  # no job to take turns in: this process logs now
            if wanted:
                self._emit(level, msg, args, kwargs)
            return
        for turn in range(job.world_size):
            if turn == job.rank and wanted:
                self._emit(level, msg, args, kwargs)
            if job.world_size > 1:
                job.barrier()

    def _emit(self, level: int, msg: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kwargs["stacklevel"] = kwargs.get("stacklevel", 2) + 1
        self.logger._log(level, msg, args, **kwargs)  # past the level check, which is this process's

    # LoggerAdapter's own methods would reach log() too; these name the caller's line (stacklevel).
    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        """``log(DEBUG, ...)``."""
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
        """``log(INFO, ...)``."""
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        """``log(WARNING, ...)``."""
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: object, *args: Any, **kwargs: Any) -> None:
        """``log(ERROR, ...)``."""
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.ERROR, msg, *args, **kwargs)

    def critical(self, msg: object, *args: Any, **kwargs: Any) -> None:
        """``log(CRITICAL, ...)``."""
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.CRITICAL, msg, *args, **kwargs)

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        """``log(ERROR, ...)`` with the exception being handled."""
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.ERROR, msg, *args, exc_info=exc_info, **kwargs)

    _warned: set[str] = set()

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        """``warning`` the first time this message (with these arguments) is given, then never again."""
        key = repr((self.logger.name, msg, args, sorted(kwargs.items())))
        if key not in self._warned:
            self._warned.add(key)
            self.log(logging.WARNING, msg, *args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A logger that follows xshard's per-process levels and rank prefix and takes Accelerate's
    ``main_process_only`` / ``in_order`` keywords (Accelerate's ``get_logger``; call it from user code).

    ``log_level`` sets this logger's level on every process (as Accelerate's argument does).
    """
    logger = logging.getLogger(name)
    if log_level is not None:
        _explicit_levels[name] = parse_level(log_level, "log_level")
        logger.setLevel(_explicit_levels[name])
    if not (name == "xshard" or name.startswith("xshard.")):  # children of "xshard" inherit its handler
        _managed.add(name)
        _apply(logger, _current)
    return MultiProcessAdapter(logger, {})


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
