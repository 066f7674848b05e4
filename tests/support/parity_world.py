"""One 2-rank gloo world shared by every parity file of a pytest run.

Starting a world (spawning Python, importing torch, forming the process group) costs several seconds; a
parity case costs a fraction of one. So the files that compare sharded training with plain PyTorch on two
ranks (``test_sharding_parity.py`` and the policy files ``test_offload.py``,
``test_activation_checkpointing.py``) do not start a world each: every such file declares its cases as a
module constant ``WORLD2_GROUPS`` (group name -> list of ``sharding_harness.case``), the ``world2``
fixture of ``tests/conftest.py`` gathers the groups of every selected test that uses it, runs them all in
ONE job, and hands each file the results of its own groups. A file run alone (or a ``-k`` selection) runs
only its own cases.
"""

from __future__ import annotations

from typing import Any

from support.distributed import run_workers
from support.sharding_harness import CASE, assert_matches, reference, run_cases

#: the module constant a parity file declares its 2-rank cases in
GROUPS_ATTR = "WORLD2_GROUPS"

Results = dict[str, list[list[dict[str, Any]]]]  # group -> one entry per case -> one result per rank


def groups_of(items: list[Any], fixture: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The ``WORLD2_GROUPS`` of every module with a selected test that uses ``fixture``, by module name."""
    modules = dict.fromkeys(item.module for item in items if fixture in getattr(item, "fixturenames", ()))
    return {module.__name__: getattr(module, GROUPS_ATTR) for module in modules}


def run_shared(world_size: int, by_module: dict[str, dict[str, list[dict[str, Any]]]],
               timeout: float = 270) -> dict[str, Results]:
    """Run every module's groups in one job of ``world_size`` ranks; results by module, then group."""
    order = [(module, group) for module, groups in by_module.items() for group in groups]
    cases = [c for module, group in order for c in by_module[module][group]]
    flat = run_workers(run_cases, world_size, cases, timeout=timeout)
    out: dict[str, Results] = {module: {} for module in by_module}
    i = 0
    for module, group in order:
        n = len(by_module[module][group])
        out[module][group] = [[rank_results[i + j] for rank_results in flat] for j in range(n)]
        i += n
    return out


def check_group(cases: list[dict[str, Any]], results: list[list[dict[str, Any]]], label: str, atol: float,
                rtol: float = 0.0) -> None:
    """Every case of a group matches plain PyTorch on the full batch (``sharding_harness.assert_matches``).

    Every case is checked before the test fails, and the failure lists each failing case (its stage and
    the options that differ from the default case) with the first thing that differed: a bug in one
    stage's path and a bug in all of them read differently.
    """
    failures = []
    for c, per_rank in zip(cases, results, strict=True):
        name = f"stage {c['stage']} {describe(c)}"
        try:
            assert_matches(per_rank, reference(c), atol=atol, rtol=rtol, label=name)
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0] if str(exc) else f"{name}: differs")
    assert not failures, f"{len(failures)} of {len(cases)} {label} cases differ from plain PyTorch:\n" + \
        "\n".join(failures)


def describe(c: dict[str, Any]) -> str:
    """A case's options that differ from the default case (``sharding_harness.CASE``), stage aside."""
    return ", ".join(f"{k}={v!r}" for k, v in c.items() if k != "stage" and CASE[k] != v) or "default"
