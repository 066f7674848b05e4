"""The suite reports what it says. The suite's files are read with ``ast`` (no test of theirs runs here);
the helpers that report hangs run on a toy job of two processes.

- A hang is reported by the test's own timeout, not by pytest-timeout. ``run_workers`` (and the other
  helpers of ``tests/support/`` that take a ``timeout``) report a hang with every rank's Python stacks,
  and a subprocess's ``timeout=`` names the command and, through ``support.jobs.run_job``, shows its
  output and its processes' stacks; pytest-timeout, when it fires first, kills the test with only the
  pytest process's own stack. So every timeout a test waits under (in its body, in the helpers of its
  module that it calls, in its fixtures) ends at least ``MARGIN_S`` seconds before the pytest timeout
  that applies to it: its ``@pytest.mark.timeout`` (the closest one: the test's, its class's, its
  module's ``pytestmark``), else ``timeout`` of ``[tool.pytest.ini_options]`` in pyproject.toml;
  pytest-timeout's marker replaces the ini value for that test, it does not add to it. A test that
  waits several times in a row is kept honest at run time too: ``support.deadline.fit`` shortens the
  helpers' timeouts to what is left of the test's (``tests/conftest.py`` records its deadline).
- The dependencies of the ``[test]`` extra are installed, at the pinned versions: a test that needs one
  fails without it rather than skipping (``pytest.importorskip`` is kept for torch_xla alone, which lives
  in .venv-xla, with a reason that the summary prints; ``make test-xla`` sets ``XSHARD_REQUIRE_XLA=1``,
  under which a missing torch_xla stops the run).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself installs tomli there
    import tomli as tomllib

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: seconds between a test's last possible inner timeout and pytest-timeout's: the test's setup (its
#: fixtures), the inner timeout's own report (run_workers kills its ranks, run_job collects the stacks)
MARGIN_S = 30

#: calls whose ``timeout=`` is not a wait of the test (a process group's or a socket's own timeout)
NOT_WAITS = {"init_process_group", "Accelerator", "InitProcessGroupKwargs", "create_connection", "timedelta",
             "TCPStore"}


def ini_timeout() -> float:
    return float(PYPROJECT["tool"]["pytest"]["ini_options"]["timeout"])


def _support_defaults() -> dict[str, float]:
    """The helpers of tests/support/ that take a ``timeout``, with its default: a call that passes none waits
    that long."""
    found = {}
    for path in sorted((TESTS / "support").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                args = node.args.posonlyargs + node.args.args
                pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults, strict=True))
                pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True) if d is not None]
                for arg, default in pairs:
                    if arg.arg == "timeout" and isinstance(default, ast.Constant):
                        found[node.name] = float(default.value)
    return found


SUPPORT = _support_defaults()


@dataclass
class Wait:
    seconds: float | None  # None: an expression this reading cannot evaluate
    where: str  # file:line of the call


@dataclass
class Module:
    path: Path
    tree: ast.Module
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    constants: dict[str, ast.expr] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Module:
        module = cls(path, ast.parse(path.read_text()))
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef):
                module.functions[node.name] = node
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                module.constants[node.targets[0].id] = node.value
        return module

    def value(self, node: ast.expr, bound: dict[str, float | None]) -> float | None:
        """A number the expression surely has when the suite runs as ``make test`` runs it (None: unknown)."""
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.Name):
            if node.id in bound:
                return bound[node.id]
            if node.id in self.constants:
                return self.value(self.constants[node.id], {})
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            a, b = self.value(node.left, bound), self.value(node.right, bound)
            if a is None or b is None:
                return None
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        # int(os.environ.get("NAME", "3")): the default, which is what `make test` runs
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("int", "float")
                and len(node.args) == 1 and isinstance(node.args[0], ast.Call)
                and ast.unparse(node.args[0].func) == "os.environ.get" and len(node.args[0].args) == 2
                and isinstance(node.args[0].args[1], ast.Constant)):
            return float(node.args[0].args[1].value)
        return None

    def waits(self, fn: ast.FunctionDef, bound: dict[str, float | None], depth: int = 0) -> list[Wait]:
        """Every timeout ``fn`` waits under, its own calls' and those of the module's helpers it calls."""
        found: list[Wait] = []
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            where = f"{self.path.name}:{node.lineno}"
            given = next((kw.value for kw in node.keywords if kw.arg == "timeout"), None)
            if isinstance(node.func, ast.Name) and name in self.functions and name != fn.name and depth < 4:
                helper = self.functions[name]
                found += self.waits(helper, self._bind(helper, node, bound), depth + 1)
            elif given is not None and name not in NOT_WAITS:
                found.append(Wait(self.value(given, bound), where))
            elif given is None and name in SUPPORT:
                found.append(Wait(SUPPORT[name], where))
        return found

    def _bind(self, helper: ast.FunctionDef, call: ast.Call, bound: dict[str, float | None]) -> dict[str, float | None]:
        """The numbers a call gives the helper's parameters (its defaults where the call gives none)."""
        args = helper.args.posonlyargs + helper.args.args
        names = {}
        for arg, default in zip(args[len(args) - len(helper.args.defaults):], helper.args.defaults, strict=True):
            names[arg.arg] = self.value(default, {})
        for arg, default in zip(helper.args.kwonlyargs, helper.args.kw_defaults, strict=True):
            if default is not None:
                names[arg.arg] = self.value(default, {})
        if not any(isinstance(a, ast.Starred) for a in call.args):
            for arg, given in zip(args, call.args, strict=False):
                names[arg.arg] = self.value(given, bound)
        for kw in call.keywords:
            if kw.arg is not None:
                names[kw.arg] = self.value(kw.value, bound)
        return names


def _marks(decorators: list[ast.expr]) -> list[ast.expr]:
    out = []
    for d in decorators:
        out += d.elts if isinstance(d, ast.List | ast.Tuple) else [d]
    return out


def _timeout_mark(module: Module, marks: list[ast.expr]) -> float | None:
    for mark in marks:
        if isinstance(mark, ast.Call) and ast.unparse(mark.func) == "pytest.mark.timeout":
            given = mark.args[0] if mark.args else next(kw.value for kw in mark.keywords if kw.arg == "timeout")
            seconds = module.value(given, {})
            assert seconds is not None, f"{module.path.name}:{mark.lineno}: a timeout mark this test cannot read"
            return seconds
    return None


def _conftest_fixtures() -> Module:
    return Module.read(TESTS / "conftest.py")


def _is_fixture(fn: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def _fixture_waits(modules: list[Module], fn: ast.FunctionDef, seen: set[str]) -> list[Wait]:
    """The waits of the fixtures ``fn`` takes (those of its module and conftest.py), theirs included."""
    found = []
    for arg in fn.args.args:
        for module in modules:
            fixture = module.functions.get(arg.arg)
            if fixture is not None and _is_fixture(fixture) and arg.arg not in seen:
                seen.add(arg.arg)
                found += module.waits(fixture, {}) + _fixture_waits(modules, fixture, seen)
                break
    return found


@dataclass
class TestWaits:
    __test__ = False  # not a test class: what the reading found for one test
    name: str
    timeout: float
    waits: list[Wait]


def _test_waits(module: Module, conftest: Module, fn: ast.FunctionDef, outer_mark: float | None,
                qualname: str) -> TestWaits:
    mark = _timeout_mark(module, _marks(fn.decorator_list))
    timeout = next((t for t in (mark, outer_mark) if t is not None), ini_timeout())
    waits = module.waits(fn, {}) + _fixture_waits([module, conftest], fn, set())
    return TestWaits(f"{module.path.name}::{qualname}", timeout, waits)


def read_suite() -> list[TestWaits]:
    """Every test of tests/test_*.py with the pytest timeout that applies to it and the timeouts it waits under."""
    conftest = _conftest_fixtures()
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        module = Module.read(path)
        module_mark = _timeout_mark(module, _marks([module.constants["pytestmark"]])) \
            if "pytestmark" in module.constants else None
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                found.append(_test_waits(module, conftest, node, module_mark, node.name))
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                class_mark = _timeout_mark(module, _marks(node.decorator_list))
                for item in node.body:
                    if isinstance(item, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in item.targets):
                        class_mark = _timeout_mark(module, _marks([item.value])) or class_mark
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                        found.append(_test_waits(module, conftest, item,
                                                 class_mark if class_mark is not None else module_mark,
                                                 f"{node.name}::{item.name}"))
    return found


def test_the_reading_finds_the_suites_read_suite() -> None:
    """The reading itself: it sees the suite's tests and the waits of a few known ones."""
    tests = {t.name: t for t in read_suite()}
    assert len(tests) > 500
    assert SUPPORT["run_workers"] == 240 and "run_replicas" in SUPPORT
    # a wait in a helper of the module, bound through the helper's parameter
    launch = tests["test_launch.py::test_a_node_whose_peers_never_join_gives_up_after_the_join_timeout"]
    assert [w.seconds for w in launch.waits] == [120]
    # a fixture's wait (conftest.py's tiny_model) counts for the tests that take it
    assert 120 in [w.seconds for w in tests["test_trainer_peft_trl.py::test_trl_sft_trainer_through_the_mixin_gives_trls_losses"].waits]
    assert tests["test_checkpoint_chaos.py::test_kills_at_random_moments_never_cost_the_run"].timeout > ini_timeout()


def test_every_inner_timeout_ends_before_the_pytest_timeout_of_its_test() -> None:
    late, unread = [], []
    for test in read_suite():
        for wait in test.waits:
            if wait.seconds is None:
                unread.append(f"{test.name}: {wait.where}")
            elif wait.seconds + MARGIN_S > test.timeout:
                late.append(f"{test.name}: {wait.where} waits {wait.seconds:g} s, pytest-timeout ends the test at "
                            f"{test.timeout:g} s")
    assert not unread, "timeouts this reading cannot evaluate (use a number, or a module constant):\n" + "\n".join(unread)
    assert not late, (f"a hang would be cut by pytest-timeout, without the ranks' stacks, before the test's own "
                      f"timeout reports it (allow {MARGIN_S} s between them):\n" + "\n".join(late))


@pytest.mark.timeout(100)
def test_a_helpers_timeout_is_shortened_to_end_before_the_tests_pytest_timeout() -> None:
    """conftest.py records the deadline that this test's mark sets; ``fit`` ends a helper's wait before it."""
    from support.deadline import MARGIN_S as HELPER_MARGIN_S
    from support.deadline import fit

    assert 100 - HELPER_MARGIN_S - 5 < fit(240) <= 100 - HELPER_MARGIN_S
    assert fit(10) == 10  # a short timeout is kept as it is


def _requirement(spec: str) -> tuple[str, str | None]:
    """(distribution, pinned version or None) of a requirement of pyproject.toml."""
    name, _, pinned = re.split(r"(==)", spec, maxsplit=1) if "==" in spec else (re.split(r"[<>=!~ ;\[]", spec)[0], "", None)
    return name.strip(), pinned


def test_every_dependency_of_the_test_extra_is_installed_as_pinned() -> None:
    """``pip install -e ".[test]"`` (``make install``) installed what the suite needs: a test that imports one of
    these fails without it rather than skipping, so a broken environment shows here first, by name."""
    wrong = []
    for spec in PYPROJECT["project"]["optional-dependencies"]["test"]:
        name, pinned = _requirement(spec)
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed")
            continue
        if pinned is not None and version != pinned:
            wrong.append(f"{name}: {version} installed, the [test] extra pins {pinned}")
    assert not wrong, "the [test] extra is not what is installed (make install):\n" + "\n".join(wrong)


#: the only module a test may skip without: torch_xla lives in .venv-xla (make test-xla); its tests are marked xla
OPTIONAL = ("torch_xla",)


def test_only_torch_xla_is_imported_or_skipped_and_each_skip_says_why() -> None:
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.importorskip":
                module = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                reason = any(kw.arg == "reason" for kw in node.keywords)
                if not (isinstance(module, str) and module.split(".")[0] in OPTIONAL and reason):
                    found.append(f"{path.name}:{node.lineno}: pytest.importorskip({module!r}"
                                 f"{', reason=...' if reason else ''})")
    assert not found, ("a dependency of the [test] extra is needed, not optional (import it), and a torch_xla skip "
                       "names what the test needs (reason=...):\n" + "\n".join(found))


_LAUNCHER = """
import subprocess, sys, time

def launcher_is_stuck_too():
    subprocess.run([sys.executable, sys.argv[1]])
    print("the rank ended", flush=True)
    time.sleep(600)

launcher_is_stuck_too()
"""

_RANK = """
import sys, time

def rank_is_stuck():
    print("rank started", flush=True)
    time.sleep(600)

rank_is_stuck()
"""


def test_a_hung_job_is_reported_with_each_of_its_processes_stacks(tmp_path) -> None:
    """run_job: a job whose processes never end fails the test with each one's stacks (the rank's where it
    waited, then the launcher's) and the output so far, not with a bare TimeoutExpired."""
    from support.jobs import run_job

    (tmp_path / "launcher.py").write_text(_LAUNCHER)
    (tmp_path / "rank.py").write_text(_RANK)
    with pytest.raises(AssertionError) as failure:
        run_job([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "rank.py")], timeout=4)
    report = str(failure.value)
    assert "did not finish in 4s" in report and "rank started" in report and "the rank ended" in report
    assert "in rank_is_stuck" in report and "in launcher_is_stuck_too" in report, report
