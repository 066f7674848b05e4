"""Environment variables for the duration of a block (the launchers and tests)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


def _apply(values: Mapping[str, str | None]) -> None:
    """Set each variable, or unset it where the value is None."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def env_override(**values: str | None) -> Iterator[None]:
    """Set or unset environment variables for the duration of a block (tests and the launcher)."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(old)
