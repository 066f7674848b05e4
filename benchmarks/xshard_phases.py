"""Where xshard's step time goes: exclusive wall time per phase of the sharded core, in one process.

``install()`` wraps a few methods of the core (gather, reduce, hooks, stage-0 buckets) and of the
collectives (issuing an operation, waiting for one) with timers. Time is exclusive: a phase's time
excludes the phases it calls, so "waiting for communication" is only the time a rank sat blocked in
``Handle.wait``, and "unpack gathered rows" only the copies. Compute is what remains of the step.
Each phase also gets the calling thread's CPU time, which a busy machine disturbs less than wall time.
The wrappers add a few microseconds per call; the benchmark uses them only with ``--profile``.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

#: (module, class or None for a function of the module, method) -> phase label
_PHASES = {
    ("xshard.backends.collectives.handle", "Handle", "wait"): "wait: blocked on communication",
    ("xshard.backends.collectives.process_group", "DistCollectives", "_all_gather"):
        "issue all-gather (incl. own-chunk copy)",
    ("xshard.backends.collectives.process_group", "DistCollectives", "_reduce_scatter"): "issue reduce-scatter",
    ("xshard.backends.collectives.process_group", "DistCollectives", "_all_reduce"): "issue all-reduce",
    ("xshard.sharding.unit", "Unit", "start_gather"): "gather: allocate + pack own shard",
    ("xshard.sharding.unit", "Unit", "wait_gather"): "gather: allocate + unpack rows into full params",
    ("xshard.sharding.unit", "Unit", "reshard"): "reshard: free full params",
    ("xshard.sharding.reduce", None, "start_reduce"): "reduce: allocate + pack full grads",
    ("xshard.sharding.reduce", "PendingReduce", "finish"): "reduce: finish (slice copy, divide)",
    ("xshard.sharding.reduce", None, "accumulate_grads"): "reduce: write grad shards",
    ("xshard.sharding.shard_engine", "ShardedEngine", "_pre_forward"): "hooks: pre-forward",
    ("xshard.sharding.shard_engine", "ShardedEngine", "_post_forward"): "hooks: post-forward",
    ("xshard.sharding.shard_engine", "ShardedEngine", "_pre_backward"): "hooks: pre-backward",
    ("xshard.sharding.shard_engine", "ShardedEngine", "_post_backward"): "hooks: post-backward",
    ("xshard.sharding.shard_engine", "ShardedEngine", "_finish_backward"): "hooks: end of backward",
    ("xshard.sharding.replicate", "ReplicatedEngine", "_launch"): "stage 0: flatten bucket (cat) + issue",
    ("xshard.sharding.replicate", "ReplicatedEngine", "_finish_backward"): "stage 0: copy averages into grads",
}

seconds: dict[str, float] = defaultdict(float)
cpu_seconds: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)
_stack: list[list[float]] = []  # [start, thread CPU start, wall and CPU time spent in nested phases]


def _timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _stack.append([time.perf_counter(), time.thread_time(), 0.0, 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            start, cpu_start, nested, nested_cpu = _stack.pop()
            elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
            seconds[label] += elapsed - nested
            cpu_seconds[label] += cpu - nested_cpu
            calls[label] += 1
            if _stack:
                _stack[-1][2] += elapsed
                _stack[-1][3] += cpu

    return wrapper


def install() -> list[str]:
    """Wrap every phase that exists in this version of the core; return the ones that do not."""
    import importlib

    missing = []
    for (module_name, cls_name, method), label in _PHASES.items():
        try:
            module = importlib.import_module(module_name)
            cls = module if cls_name is None else getattr(module, cls_name)  # None: a function of the module
            original = getattr(cls, method)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{cls_name or ''}.{method}")
            continue
        setattr(cls, method, _timed(label, original))
    return missing


def reset() -> None:
    """Zero the timers."""
    seconds.clear()
    cpu_seconds.clear()
    calls.clear()


def report() -> dict[str, dict[str, float]]:
    """``{label: {"s": wall seconds, "cpu_s": this thread's CPU seconds, "calls": n}}``, largest first."""
    return {k: {"s": round(v, 4), "cpu_s": round(cpu_seconds[k], 4), "calls": calls[k]}
            for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
