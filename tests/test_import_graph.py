"""The import graph of xshard/ and backends/ (imported as xshard.backends) has no circle.

Every import a module runs (at module level or inside a function; annotations under
``TYPE_CHECKING`` excluded, since they never run) is an edge. No module may reach itself, and the
packages (xshard.sharding, xshard.checkpoint, xshard.config, xshard.cli, xshard.trainer,
xshard.accelerate_compat, xshard.backends and the top-level modules) form no circle either. The
drawing in docs/architecture.md is this graph. Imports for annotations only (under ``TYPE_CHECKING``)
make no circle either: two modules that name each other's types cannot be read, moved or checked one
without the other, whether or not the import runs.

Accelerate's compatibility surface (``xshard.accelerate_compat``) sits between the user API and the
job machinery: only the user API and Accelerate's import paths (``xshard.state`` ..., thin modules
re-exporting it) import it, and it imports none of them, so the job machinery (JobState, the
prepared objects, data, checkpoint, config, the core) stays usable without it.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

from xshard.accelerate_compat import IMPORT_PATHS

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "backends":
        parts = ["xshard", "backends", *parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for base in ("xshard", "backends") for p in (ROOT / base).rglob("*.py")}


def _imports(tree: ast.AST, typing_too: bool) -> list[ast.Import | ast.ImportFrom]:
    typing_only = set() if typing_too else {
        id(sub) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for sub in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only]


def import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """module -> the xshard modules it imports (those it runs; with ``typing_too``, also those under
    ``TYPE_CHECKING``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")), typing_too):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])]) if node.level else node.module
                targets = [target, *(f"{target}.{a.name}" for a in node.names)]
            else:
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def package_of(module: str) -> str:
    """xshard.sharding.unit -> xshard.sharding; xshard.accelerator -> xshard.accelerator."""
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for t in targets:
            a, b = package_of(module), package_of(t)
            if a != b:
                out.setdefault(a, set()).add(b)
    return out


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(import_graph()) == []


def test_no_module_imports_itself_even_for_annotations() -> None:
    """A circle closed by an annotation-only import is a circle all the same (the piece both sides
    need belongs in a module of its own, or with the side that owns it)."""
    assert cycles(import_graph(typing_too=True)) == []


def test_no_package_imports_itself_through_others() -> None:
    assert cycles(package_graph(import_graph())) == []


#: the leaf every layer imports its errors from
ERRORS = "xshard.errors"


def test_the_errors_are_the_leaf_of_the_graph() -> None:
    assert import_graph()[ERRORS] == set()


def test_the_device_layer_knows_nothing_of_sharding_or_the_user_api() -> None:
    reached = {t for m, ts in import_graph().items() if m.startswith("xshard.backends") for t in ts}
    assert {package_of(t) for t in reached} <= {"xshard.backends", ERRORS}


def test_the_core_knows_nothing_of_the_user_api() -> None:
    reached = {package_of(t) for m, ts in import_graph().items() if m.startswith("xshard.sharding") for t in ts}
    assert reached <= {"xshard.sharding", "xshard.backends", ERRORS}


#: the user API: what a script imports to train
USER_API = {"xshard", "xshard.accelerator", "xshard.trainer"}
#: Accelerate's import paths, each a thin module re-exporting one module (the one list: accelerate_compat's)
ACCELERATE_PATHS = set(IMPORT_PATHS)
#: what the Accelerator is made of (docs/architecture.md, "Which module is which")
JOB_MACHINERY = {"xshard.runtime", "xshard.static_shapes", "xshard.checkpoint", "xshard.config", "xshard.sharding"}


def test_the_job_machinery_imports_neither_the_user_api_nor_the_accelerate_surface() -> None:
    reached = {package_of(t) for m, ts in import_graph().items() if package_of(m) in JOB_MACHINERY for t in ts}
    above = USER_API | ACCELERATE_PATHS | {"xshard.accelerate_compat", "xshard.cli",
                                           "xshard.pretrained", "xshard.estimate"}
    assert reached & above == set()


def test_only_the_user_api_imports_the_accelerate_surface() -> None:
    importers = {package_of(m) for m, ts in import_graph().items() if package_of(m) != "xshard.accelerate_compat"
                 and any(package_of(t) == "xshard.accelerate_compat" for t in ts)}
    assert importers <= USER_API | ACCELERATE_PATHS


def test_the_accelerate_surface_imports_no_user_api() -> None:
    reached = {package_of(t) for m, ts in import_graph().items() if package_of(m) == "xshard.accelerate_compat"
               for t in ts}
    assert reached & (USER_API | ACCELERATE_PATHS) == set()


def test_a_circle_is_found_when_there_is_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_public_name_of_the_core_resolves_to_its_module() -> None:
    """``xshard.sharding`` imports its model module on first use; each name in ``__all__`` is found, and is
    not shadowed by a submodule of the same name."""
    import xshard.sharding as core

    for name in core.__all__:
        value = getattr(core, name)
        assert not isinstance(value, types.ModuleType), name
        assert getattr(importlib.import_module(value.__module__), name) is value, name


def test_the_cli_and_the_config_reader_start_without_the_compiler_stack() -> None:
    """`xshard env` / `config` / `estimate` do not import torch._dynamo (1.2 s a call here), which only the
    engines' ``torch.compiler.disable``d hooks need."""
    code = ("import sys, contextlib, io\n"
            "from xshard.cli import main\n"
            "import xshard.config, xshard.estimate\n"
            "sys.argv = ['xshard', 'env', '--backend', 'cpu']\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    code = main()\n"
            "print(code, 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["0", "False"], done.stderr
