"""The current test's pytest-timeout deadline, so that a helper's own timeout fires before it.

pytest-timeout ends a test that runs past its timeout (``[tool.pytest.ini_options] timeout``, or the
test's ``@pytest.mark.timeout``, which replaces it) with the stack of the pytest process alone. The helpers
that wait on other processes (``run_workers``, ``run_replicas``) report a hang better: with every rank's
Python stacks. ``tests/conftest.py`` records when pytest-timeout will end the running test; ``fit``
shortens a helper's timeout so that it fires ``MARGIN_S`` seconds before that, however much of the test's
time earlier steps (fixtures, earlier jobs) took. Outside a test run there is no deadline and ``fit``
returns the timeout unchanged.
"""

from __future__ import annotations

import time

#: seconds left between a helper's timeout and pytest-timeout's: its report (the ranks' stacks) and cleanup
MARGIN_S = 20
#: the shortest timeout ``fit`` gives, so that a test already late still starts its job and reports
FLOOR_S = 5.0

_deadline: float | None = None


def set_deadline(seconds: float | None) -> None:
    """Called by conftest.py as a test starts (its pytest-timeout, None or 0 when it has none), and with
    None as it ends."""
    global _deadline
    _deadline = time.monotonic() + seconds if seconds else None


def fit(timeout: float) -> float:
    """``timeout``, shortened to end ``MARGIN_S`` seconds before pytest-timeout ends the running test."""
    if _deadline is None:
        return timeout
    return min(timeout, max(FLOOR_S, _deadline - time.monotonic() - MARGIN_S))
