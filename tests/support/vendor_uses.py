"""What xshard's device layer uses of the vendor modules, found by reading its source with ``ast``.

``scan(folder)`` walks every ``.py`` file under ``folder`` (backends/) and returns each vendor name
the code reaches, with the keywords it passes, as ``Use(name, keywords, where)``. Names are written
the way the vendor module is reached at run time:

- ``torch.cuda.X``, ``torch.npu.X``, ``torch.tpu.X``, ``torch.accelerator.X``, ``torch.amp.X``, ... as written;
- ``self.device_module().X`` inside a class method: once per backend class that runs that method,
  as ``torch.<device_type>.X`` (so base-class code is checked against every device module it serves);
- ``xm.X`` / ``xla_model().X`` as ``torch_xla.core.xla_model.X``, ``xr.X`` / ``_runtime().X`` as
  ``torch_xla.runtime.X``, and names imported ``from torch_xla...`` by their full path.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

#: how a call or name in the source reaches a vendor module
ALIASES = {
    "xm": "torch_xla.core.xla_model",
    "xla_model()": "torch_xla.core.xla_model",
    "xr": "torch_xla.runtime",
    "_runtime()": "torch_xla.runtime",
}
VENDOR_ROOTS = ("torch.cuda", "torch.npu", "torch.mps", "torch.backends.mps", "torch.backends.cuda", "torch.amp",
                "torch.autocast", "torch.version.cuda", "torch_xla", "torch_npu", "torch.tpu", "torch_tpu",
                "torch.accelerator")


@dataclass(frozen=True)
class Use:
    """One vendor name the code reaches, and where (file:line). A call also has the number of
    positional arguments (None: not a call, or ``*args``) and the keywords passed."""

    name: str
    keywords: frozenset[str]
    where: str
    positional: int | None = None


def _dotted(node: ast.AST) -> str | None:
    """``a.b().c`` -> "a.b().c" for chains of names, attributes, argument-free calls and
    ``getattr(chain, "name"[, default])`` (a probe is a use too)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base is not None else None
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        base = _dotted(node.func)
        return f"{base}()" if base is not None else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        base = _dotted(node.args[0])
        return f"{base}.{node.args[1].value}" if base is not None else None
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, device_modules: Callable[[str, str], Iterable[str]]) -> None:
        self.path = path
        self.device_modules = device_modules  # (class name, method name) -> ["torch.npu", ...]
        self.imported: dict[str, str] = {}
        self.bound: dict[str, str] = {}  # `mod = self.device_module()`, `self._xm = xla_model()`: name -> chain
        self.cls: list[str] = []
        self.func: list[str] = []
        self.uses: list[Use] = []
        self.returned_keys: dict[str, set[str]] = {}  # method -> keys of the dict literal it returns

    def collect_returned_keys(self, tree: ast.Module) -> None:
        """Keys a call's ``**self.method()`` passes: those of the dict literals ``method`` returns."""
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
                        self.returned_keys.setdefault(node.name, set()).update(
                            k.value for k in ret.value.keys if isinstance(k, ast.Constant))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] in ("torch_xla", "torch_npu"):
            for alias in node.names:
                self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                self._add(f"{node.module}.{alias.name}", (), node)

    def visit_Assign(self, node: ast.Assign) -> None:
        value = _dotted(node.value)
        if value is not None and (value in ALIASES or value == "self.device_module()"):
            for target in node.targets:
                name = _dotted(target)
                if name is not None:
                    self.bound[name] = value
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.cls.append(node.name)
        self.generic_visit(node)
        self.cls.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.func.append(node.name)
        self.generic_visit(node)
        self.func.pop()

    def visit_Call(self, node: ast.Call) -> None:
        chain = _dotted(node.func)
        if chain is not None:
            keywords = {k.arg for k in node.keywords if k.arg}
            for k in node.keywords:
                expanded = _dotted(k.value.func) if k.arg is None and isinstance(k.value, ast.Call) else None
                if expanded and expanded.startswith("self."):
                    keywords |= self.returned_keys.get(expanded[len("self."):], set())
            starred = any(isinstance(a, ast.Starred) for a in node.args)
            if self._chain(chain, keywords, node, None if starred else len(node.args)):
                for child in [*node.args, *node.keywords]:  # not node.func: this call is its use
                    self.visit(child)
                return
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _dotted(node)
        if chain is not None:
            self._chain(chain, set(), node)
            return  # the chain's prefixes are not uses of their own
        self.generic_visit(node)

    def _chain(self, chain: str, keywords: set[str], node: ast.AST, positional: int | None = None) -> bool:
        """Record ``chain`` if it reaches a vendor module; True when it did."""
        for name, value in self.bound.items():
            if chain.startswith(name + "."):
                chain = value + chain[len(name):]
                break
        head, _, rest = chain.partition(".")
        for alias, module in ALIASES.items():
            if chain.startswith(alias + "."):
                return self._add(module + chain[len(alias):], keywords, node, positional)
        if head in self.imported:
            return self._add(f"{self.imported[head]}.{rest}" if rest else self.imported[head], keywords, node,
                             positional)
        if chain.startswith("self.device_module()."):
            tail = chain[len("self.device_module()."):]
            for module in self.device_modules(self.cls[-1] if self.cls else "", self.func[-1] if self.func else ""):
                self._add(f"{module}.{tail}", keywords, node, positional)
            return True
        if chain.startswith(VENDOR_ROOTS) and chain.rstrip("()") not in VENDOR_ROOTS[:5]:
            return self._add(chain, keywords, node, positional)
        return False

    def _add(self, name: str, keywords: Iterable[str], node: ast.AST, positional: int | None = None) -> bool:
        name = name.replace("()", "")
        self.uses.append(Use(name, frozenset(keywords), f"{self.path}:{getattr(node, 'lineno', 0)}", positional))
        return True


def scan(folder: Path, backend_classes: Iterable[type]) -> list[Use]:
    """Every vendor use in the ``.py`` files under ``folder`` (see the module docstring)."""
    classes = list(backend_classes)

    def device_modules(cls_name: str, method: str) -> list[str]:
        """The device modules that run ``cls_name.method`` through ``self.device_module()``."""
        modules = []
        for backend in classes:
            if backend.device_type not in ("cuda", "npu", "mps", "tpu") or not method:
                continue
            static = inspect.getattr_static(backend, method, None)
            fn = getattr(static, "fget", static)
            fn = getattr(fn, "__func__", fn)
            if getattr(fn, "__qualname__", "") == f"{cls_name}.{method}":
                modules.append(f"torch.{backend.device_type}")
        return modules

    uses: list[Use] = []
    for path in sorted(folder.rglob("*.py")):
        scanner = _Scanner(str(path.relative_to(folder.parent)), device_modules)
        tree = ast.parse(path.read_text(), str(path))
        scanner.collect_returned_keys(tree)
        scanner.visit(tree)
        uses.extend(scanner.uses)
    return uses
