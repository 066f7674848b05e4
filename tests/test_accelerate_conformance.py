"""Accelerate's surface by enumeration: every public member of the installed accelerate has a row saying what
xshard does with it, and the rows are true.

The members come from the installed accelerate, enumerated in a process of its own
(``python -m xshard.accelerate_compat.conformance --json``; ``conformance/installed.py`` says what counts: the
``Accelerator``'s class members and the attributes a real ``Accelerator(cpu=True)`` sets, the prepared optimizer,
scheduler and loader likewise (the loader with what it hands on from torch's ``DataLoader``), every public name
of ``accelerate.utils`` that is not a submodule (it has no ``__all__``), and the fields of its ``*Plugin``,
``*Kwargs`` and ``*Configuration`` dataclasses). So a new Accelerate release shows its new members here as failures, never as silence.

- every member has a row, and no row but a refused one names a member the installed accelerate lacks;
- every row names a test that exists (the one comparing it with Accelerate, or showing its warning or error);
- a refused member raises an error carrying its row's way; a member with any other status is there;
- docs/accelerate-scripts.md's tables are the generator's output (a stale page fails).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from xshard.accelerate_compat.conformance import DOC_BEGIN, DOC_END, SURFACES, Row, Surface, rows_of

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
DOC = ROOT / "docs" / "accelerate-scripts.md"
STATUSES = {"same", "different", "warned", "refused"}


@pytest.fixture(scope="module")
def installed() -> dict[str, Any]:
    """The installed accelerate's members by surface, and the generator's markdown (one subprocess: it builds
    Accelerate's own Accelerator, which must not share this process with xshard's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "xshard.accelerate_compat.conformance", "--json"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rows(surface: Surface) -> dict[str, Row]:
    rows = rows_of(surface)
    assert rows is not None, (f"xshard/accelerate_compat/conformance/{surface.module}.py with {surface.rows} is "
                              f"missing: write the rows of {surface.title}")
    return rows


@pytest.mark.parametrize("surface", SURFACES, ids=[s.rows for s in SURFACES])
def test_every_member_of_accelerates_surface_has_a_row(installed, surface):
    rows = _rows(surface)
    members = set(installed["members"][surface.title])
    lacking = sorted(members - set(rows))
    assert lacking == [], (f"{len(lacking)} member(s) of {surface.title} (accelerate {installed['version']}) have "
                           f"no row in conformance/{surface.module}.py {surface.rows}: {lacking}")
    # a refused row may name a member only some configurations set (deepspeed_engine_wrapped under DeepSpeed);
    # a row saying xshard does something must name a member the installed accelerate has
    stale = sorted(name for name, row in rows.items() if name not in members and row.status != "refused")
    assert stale == [], f"rows of {surface.rows} for members accelerate {installed['version']} lacks: {stale}"


def _test_functions(file: str) -> set[str]:
    path = TESTS / file
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("surface", SURFACES, ids=[s.rows for s in SURFACES])
def test_every_row_names_its_status_and_a_test_that_exists(surface):
    wrong = {}
    for member, row in _rows(surface).items():
        file, _, name = row.test.partition("::")
        if row.status not in STATUSES:
            wrong[member] = f"status {row.status!r} is none of {sorted(STATUSES)}"
        elif not row.how.strip():
            wrong[member] = "no how"
        elif name.split("[")[0] not in _test_functions(file):
            wrong[member] = f"test {row.test!r} does not exist in tests/"
    assert wrong == {}, f"{surface.rows}: {wrong}"


@pytest.fixture(scope="module")
def ours():
    """xshard's Accelerator (one CPU process) and a loader it prepared."""
    import xshard

    acc = xshard.Accelerator(backend="cpu", stage=0)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2))
    yield {"accelerate.Accelerator": acc, "DataLoaderShard (the prepared data loader)": loader}
    acc.end()


def _owner(surface: Surface, ours: dict[str, Any]) -> Any:
    if surface.module == "utils_names":
        import xshard.utils

        return xshard.utils
    return ours[surface.title]


MINE = [s for s in SURFACES if s.module in ("accelerator", "loader", "utils_names")]


@pytest.mark.parametrize("surface", MINE, ids=[s.rows for s in MINE])
def test_every_refused_member_names_xshards_way(surface, ours):
    owner = _owner(surface, ours)
    silent = {}
    for member, row in _rows(surface).items():
        if row.status != "refused":
            continue
        try:
            getattr(owner, member)
        except (AttributeError, ImportError) as exc:
            if row.how not in str(exc):
                silent[member] = str(exc)
        else:
            silent[member] = "xshard has it: its row must say what it does"
    assert silent == {}, f"refused members whose error does not name the row's way: {silent}"


def test_a_utils_name_xshard_lacks_fails_its_import_with_xshards_way():
    with pytest.raises(ImportError, match=re.escape("xshard.utils.gather_object is Accelerate's") + ".*"
                       + re.escape("accelerator.gather_for_metrics(obj, use_gather_object=True)")):
        from xshard.utils import gather_object  # noqa: F401
    import xshard.utils

    assert not hasattr(xshard.utils, "no_such_name")  # any other name: a plain AttributeError


@pytest.mark.parametrize("surface", MINE, ids=[s.rows for s in MINE])
def test_every_member_with_a_behaviour_is_there(surface, ours):
    owner = _owner(surface, ours)
    absent = sorted(member for member, row in _rows(surface).items()
                    if row.status != "refused" and not hasattr(owner, member))
    assert absent == [], f"rows say xshard does something with these, but it lacks them: {absent}"


def test_the_docs_tables_are_the_generators(installed):
    text = DOC.read_text()
    assert DOC_BEGIN in text and DOC_END in text, f"{DOC.name} needs the section between {DOC_BEGIN} and {DOC_END}"
    page = text.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0].strip()
    assert page == installed["markdown"].strip(), (
        f"{DOC.name}'s tables are stale: run `python -m xshard.accelerate_compat.conformance --write "
        f"docs/{DOC.name}`")
