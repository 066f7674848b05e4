"""Import a script's third-party modules once per process, before replica threads run it.

XLA:CPU replicas (and TPU v2/v3 cores) are threads of one process that each run the user's script.
Python's import system is safe between threads, but lazy packages are not always: transformers
resolves ``from transformers import PreTrainedTokenizerFast`` through a module ``__getattr__`` that
imports a submodule, and two threads doing that at once can see each other's half-initialised
module (``ImportError: cannot import name 'PreTrainedTokenizerFast'``), in one replica only.

``preload_imports`` reads the script (and the modules of its own folder that it imports) with
``ast``, without running them, collects every absolute ``import x`` / ``from x import a, b`` found
anywhere in them (inside functions too: that is where lazy imports hide), and imports those of
other packages (never the script's own modules, whose top-level code runs when the script says)
under one process-wide lock. The first replica thread does the work; the others wait for it and
find everything imported. A name that fails to import is skipped: the script meets the same error
at its own line, with its own traceback.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import sys
import threading
from pathlib import Path

log = logging.getLogger("xshard.launch")

_lock = threading.Lock()
_done: set[Path] = set()
#: modules whose import side effects must happen in the script's own order (they start runtimes)
_NEVER_PRELOAD = ("torch_xla",)


def _imports_of(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of every absolute import in ``path`` (``names`` empty for ``import x``)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
    return found


def _local_file(module: str, folder: Path) -> Path | None:
    """The file of ``module`` when it is one of the script's own (in the script's folder)."""
    top = module.split(".")[0]
    for candidate in (folder / f"{top}.py", folder / top / "__init__.py"):
        if candidate.is_file():
            rest = module.split(".")[1:]
            if not rest:
                return candidate
            nested = folder.joinpath(top, *rest[:-1], f"{rest[-1]}.py")
            return nested if nested.is_file() else folder.joinpath(top, *rest, "__init__.py")
    return None


def third_party_imports(script: Path) -> list[tuple[str, tuple[str, ...]]]:
    """The imports of other packages in ``script`` and in the modules of its folder that it imports."""
    folder = script.parent
    seen: set[Path] = set()
    todo = [script]
    out: list[tuple[str, tuple[str, ...]]] = []
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for module, names in _imports_of(path):
            local = _local_file(module, folder)
            if local is not None:
                todo.append(local)
            elif module.split(".")[0] not in _NEVER_PRELOAD and module.split(".")[0] != "__future__":
                out.append((module, names))
    return out


def preload_imports(script: Path) -> None:
    """Import ``script``'s third-party modules and names once per process (see the module docstring)."""
    script = script.resolve()
    with _lock:
        if script in _done:
            return
        _done.add(script)
        folder = str(script.parent)
        added = folder not in sys.path
        if added:
            sys.path.insert(0, folder)
        try:
            for module, names in third_party_imports(script):
                _import(module, names)
        finally:
            if added:
                sys.path.remove(folder)


def _import(module: str, names: tuple[str, ...]) -> None:
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return
        imported = importlib.import_module(module)
        for name in names:
            # resolves a lazy package's attribute (which imports its submodule), or a plain submodule
            if getattr(imported, name, None) is None and hasattr(imported, "__path__"):
                importlib.import_module(f"{module}.{name}")
    except Exception as exc:  # the script meets it again where it imports it, with its own traceback
        log.debug("preload: %s not imported ahead (%s: %s)", module, type(exc).__name__, exc)
