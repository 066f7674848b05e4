"""``eager_under_compile``: the core's hooks run eagerly inside a compiled model, as with
``torch.compiler.disable``, without importing ``torch._dynamo`` in a job that never compiles.

``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates, about 1.0 s of the 1.2 s that
``import xshard`` cost beyond torch on 2 cores, paid by every rank of every job and by every CLI
call. Dynamo can only be tracing after ``torch.compile`` ran, and that imports it; so while
``torch._dynamo`` is not in ``sys.modules`` a hook is called as it is, and afterwards it goes through
``torch._disable_dynamo`` (torch's own lazy form of ``disable``: it imports dynamo at its first call).

The wrapper carries ``_torchdynamo_disable``, the mark ``torch.compiler.disable`` leaves, so Dynamo
never inlines it into a graph: it breaks the graph at the call and runs the hook eagerly, as before.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def eager_under_compile(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run eagerly inside compiled code (a graph break around it); see the module note."""
    disabled = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def hook(*args: P.args, **kwargs: P.kwargs) -> R:
        if "torch._dynamo" not in sys.modules:  # nothing can be compiling
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    hook._torchdynamo_disable = True  # type: ignore[attr-defined]
    return hook
