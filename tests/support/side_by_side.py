"""Run single-process scripts at once: the anchor library's run and xshard's run of one user program.

A one-process run of a Trainer or Accelerate script spends most of its seconds importing on one core
(``from transformers import Trainer`` alone takes about 6 s here), so on a machine with two cores two
such runs side by side take about the time of one. Each run is still its own subprocess, started as a
user starts it; only the waiting is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def side_by_side(*runs: Callable[[], T]) -> list[T]:
    """Call every ``run`` (each starts and waits for its own subprocess) at once; their results in order.

    A run's exception (a failed assertion on its exit code) is raised here, the first run's first."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run) for run in runs]
        return [future.result() for future in futures]
