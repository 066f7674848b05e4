"""The seam where every subsystem meets is typed: no ``Any`` that would let mypy accept a misspelt name.

``JobState`` is what the Accelerator, the prepared objects, the checkpoint code and the Trainer share; the
precision owner's step chain is what every optimizer step goes through. Their fields and signatures name real
types (or Protocols), the wrappers that forward attributes (``ShardedModel``, ``PreparedScheduler``,
``Accelerator``'s missing-member errors) hide that ``__getattr__`` from the type checker, and mypy runs with
``disallow_untyped_defs`` (``make typecheck``). Beside ``test_import_graph.py``, which keeps the layers apart.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from xshard.runtime.job import JobState
from xshard.runtime.mixed_precision import GradientClip, Precision

ROOT = Path(__file__).resolve().parent.parent

#: the Precision methods of one optimizer step (the chain) and of clipping
STEP_CHAIN = ("optimizer_step", "unscale", "clip_grad_norm_", "clip_grad_value_")


def _mentions_any(hint: object) -> bool:
    if hint is typing.Any:
        return True
    return any(_mentions_any(arg) for arg in typing.get_args(hint))


def _any_fields(cls: type) -> list[str]:
    from xshard.sharding import ShardedModel  # named under TYPE_CHECKING in the seam (its import is heavy)

    hints = typing.get_type_hints(cls, localns={"ShardedModel": ShardedModel})
    return [f.name for f in dataclasses.fields(cls) if _mentions_any(hints[f.name])]


def test_no_field_of_the_job_state_is_any() -> None:
    assert _any_fields(JobState) == []
    assert _any_fields(GradientClip) == []


def test_the_step_chain_names_its_types() -> None:
    loose = {}
    for name in STEP_CHAIN:
        hints = typing.get_type_hints(getattr(Precision, name))
        loose[name] = [arg for arg, hint in hints.items() if _mentions_any(hint)]
    assert loose == {name: [] for name in STEP_CHAIN}


def test_the_any_check_finds_an_any() -> None:
    @dataclasses.dataclass
    class Loose:
        config: typing.Any
        models: list[typing.Any]
        step: int = 0

    assert _any_fields(Loose) == ["config", "models"]


#: classes whose attribute forwarding must stay invisible to the type checker
FORWARDING = {"xshard/sharding/model.py": "ShardedModel", "xshard/runtime/prepared.py": "PreparedScheduler",
              "xshard/accelerator.py": "Accelerator", "xshard/runtime/data.py": "_SkipFirst"}


def _getattr_seen_by_the_type_checker(path: Path, class_name: str) -> bool:
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    # a def directly in the class body is seen; one under `if not TYPE_CHECKING:` is not
    return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in cls.body)


@pytest.mark.parametrize("path, class_name", sorted(FORWARDING.items()))
def test_no_getattr_any_where_the_type_checker_looks(path: str, class_name: str) -> None:
    assert not _getattr_seen_by_the_type_checker(ROOT / path, class_name)


def test_the_forwarding_still_works_at_run_time() -> None:
    import torch

    from xshard.runtime.prepared import PreparedScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    assert PreparedScheduler(sched, [], None).step_size == 3  # reading needs no job


def test_mypy_refuses_unannotated_functions() -> None:
    from test_suite_hygiene import PYPROJECT

    mypy = PYPROJECT["tool"]["mypy"]
    assert mypy.get("disallow_untyped_defs") is True
    assert "xshard" in mypy["packages"]


def test_job_state_is_built_with_a_precision() -> None:
    # the precision is a required field: a job without one cannot be made (no None to check at each step)
    params = inspect.signature(JobState).parameters
    assert params["precision"].default is inspect.Parameter.empty
