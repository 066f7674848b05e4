"""Names and signatures of a vendor release, read from its real code without running what cannot run.

- ``WheelSources(path)``: a downloaded wheel's Python sources, parsed with ``ast`` from the zip (torch_npu
  cannot be imported without CANN). ``lookup("torch_npu.npu.amp.GradScaler")`` follows imports
  (relative, ``from x import *``, submodules) to the definition; ``signature`` turns a ``def`` into an
  ``inspect.Signature`` (a class: its ``__init__`` / ``__new__`` without the first parameter).
- ``live_lookup`` / ``live_signature``: the same for a package this environment can import (torch,
  torch_xla).
- ``accepts(sig, positional, keywords)``: can a call with that many positional arguments and those
  keywords bind to ``sig``?
- ``npu_wheel_path()``, ``tpu_wheel_path()``: the supported torch-npu and torch-tpu releases' wheels, where
  ``make vendor-wheels`` puts them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WHEELS = Path(os.environ.get("XSHARD_VENDOR_WHEELS", Path(__file__).resolve().parents[2] / ".cache" / "vendor-wheels"))
#: the torch-npu release for the torch xshard is tested with (the Makefile names the same one)
NPU_RELEASE = os.environ.get("XSHARD_NPU_RELEASE", "2.13.0")
#: the torch-tpu (TorchTPU) release the tpu backend is written against (the Makefile names the same one)
TPU_RELEASE = os.environ.get("XSHARD_TPU_RELEASE", "0.2.0")


def npu_wheel_path() -> Path | None:
    """The downloaded torch-npu wheel of the supported release, if it is there."""
    found = sorted(WHEELS.glob(f"torch_npu-{NPU_RELEASE}-*.whl"))
    return found[-1] if found else None


def tpu_wheel_path() -> Path | None:
    """The downloaded torch-tpu wheel of the supported release, if it is there."""
    found = sorted(WHEELS.glob(f"torch_tpu-{TPU_RELEASE}-*.whl"))
    return found[-1] if found else None


@dataclass(frozen=True)
class Found:
    """A name found in a wheel: a module, a ``def`` / ``class`` / assignment in ``module``, or a name
    from a package outside the wheel (``external``: "torch.amp.grad_scaler.GradScaler")."""

    kind: str  # "module" | "def" | "class" | "value" | "external"
    module: str
    node: ast.AST | None = None
    external: str | None = None


class WheelSources:
    """The Python sources of a wheel, parsed on demand; ``replace`` swaps a file's text (for tests)."""

    def __init__(self, path: Path, replace: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        with zipfile.ZipFile(self.path) as zf:
            names = zf.namelist()
            self._text = {n: zf.read(n).decode("utf-8", "replace") for n in names
                          if n.endswith(".py") or ".dist-info/" in n and not n.endswith("/")}
        self._text.update(replace or {})
        self._trees: dict[str, ast.Module] = {}
        self._exports: dict[str, dict[str, Any]] = {}
        meta = next(t for n, t in self._text.items() if n.endswith(".dist-info/METADATA"))
        self.name = next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Name:"))
        self.version = next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Version:"))

    def dist_info(self, filename: str) -> str:
        """The text of a file of the wheel's ``.dist-info`` folder ("" if absent)."""
        return next((t for n, t in self._text.items() if n.endswith(f".dist-info/{filename}")), "")

    # ------------------------------------------------------------------ modules
    def _file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}/__init__.py", f"{base}.py"):
            if candidate in self._text:
                return candidate
        return None

    def is_module(self, module: str) -> bool:
        return self._file(module) is not None

    def source(self, module: str) -> str:
        """The text of ``module``'s file."""
        return self._text[self._file(module)]

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            self._trees[module] = ast.parse(self.source(module), self._file(module))
        return self._trees[module]

    def _package(self, module: str) -> str:
        """The package relative imports in ``module`` start from."""
        return module if self._file(module).endswith("__init__.py") else module.rpartition(".")[0]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self._package(module)
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{node.module}" if node.module else base

    def exports(self, module: str) -> dict[str, Any]:
        """Every name ``module`` binds at its top level (inside if/try blocks too), star imports expanded.

        Values: ("def"|"class"|"value", node), ("from", source module, name) or ("module", dotted).
        """
        if module in self._exports:
            return self._exports[module]
        found: dict[str, Any] = {}
        self._exports[module] = found  # a cycle of star imports stops here
        stars: list[str] = []

        def walk(statements: list[ast.stmt]) -> None:
            for node in statements:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[node.name] = ("def", node)
                elif isinstance(node, ast.ClassDef):
                    found[node.name] = ("class", node)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        for name in ast.walk(target):
                            if isinstance(name, ast.Name):
                                found[name.id] = ("value", node)
                elif isinstance(node, ast.ImportFrom):
                    source = self._absolute(module, node)
                    for alias in node.names:
                        if alias.name == "*":
                            stars.append(source)
                        else:
                            found[alias.asname or alias.name] = ("from", source, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        found[alias.asname or alias.name.split(".")[0]] = ("module", alias.asname and alias.name
                                                                           or alias.name.split(".")[0])
                elif isinstance(node, (ast.If, ast.Try, ast.With)):
                    walk(node.body)
                    walk(getattr(node, "orelse", []))
                    for handler in getattr(node, "handlers", []):
                        walk(handler.body)
                    walk(getattr(node, "finalbody", []))

        walk(self.tree(module).body)
        for source in stars:
            if self.is_module(source):
                public = self.public_names(source)
                for name in public:
                    found.setdefault(name, ("from", source, name))
        return found

    def public_names(self, module: str) -> list[str]:
        """``module``'s ``__all__`` if it is a literal list, else its names without a leading underscore."""
        for node in self.tree(module).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                try:
                    return list(ast.literal_eval(node.value))
                except ValueError:
                    break
        return [n for n in self.exports(module) if not n.startswith("_")]

    # ------------------------------------------------------------------ lookup
    def resolve(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where ``module.name`` is defined (following imports), or None when it does not exist."""
        if depth > 20:
            return None
        entry = self.exports(module).get(name)
        if entry is None:
            sub = f"{module}.{name}"
            return Found("module", sub) if self.is_module(sub) else None
        kind = entry[0]
        if kind in ("def", "class", "value"):
            return Found(kind, module, entry[1])
        if kind == "module":
            target = entry[1]
            return Found("module", target) if self.is_module(target) else Found("external", module, external=target)
        source, original = entry[1], entry[2]
        if self.is_module(source):
            return self.resolve(source, original, depth + 1)
        return Found("external", module, external=f"{source}.{original}")

    def lookup(self, dotted: str) -> Found | None:
        """``lookup("torch_npu.npu.amp.GradScaler")``: the definition, or None if a part is missing."""
        parts = dotted.split(".")
        current = Found("module", parts[0]) if self.is_module(parts[0]) else None
        for part in parts[1:]:
            if current is None:
                return None
            if current.kind == "module":
                current = self.resolve(current.module, part)
            elif current.kind == "class":
                current = self.member(current, part)
            elif current.kind == "external":
                return Found("external", current.module, external=f"{current.external}.{part}")
            else:
                return None
        return current

    def member(self, cls: Found, name: str) -> Found | None:
        """A class's own member, or one inherited from a base class in or outside the wheel."""
        for node in cls.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Found("def", cls.module, node)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return Found("value", cls.module, node)
        for base in self.bases(cls):
            if base.kind == "class":
                found = self.member(base, name)
                if found is not None:
                    return found
            elif base.kind == "external":
                try:
                    if hasattr(live_lookup(base.external), name):
                        return Found("external", base.module, external=f"{base.external}.{name}")
                except (ImportError, AttributeError):
                    continue
        return None

    def bases(self, cls: Found) -> list[Found]:
        """The class's base classes, resolved as far as the wheel's sources go."""
        out = []
        for base in cls.node.bases:
            chain = _dotted(base)
            if chain is None:
                continue
            head, _, rest = chain.partition(".")
            found = self.resolve(cls.module, head)
            for part in rest.split(".") if rest else []:
                found = self.lookup_from(found, part)
            if found is not None:
                out.append(found)
        return out

    def lookup_from(self, found: Found | None, part: str) -> Found | None:
        if found is None:
            return None
        if found.kind == "module":
            return self.resolve(found.module, part)
        if found.kind == "external":
            return Found("external", found.module, external=f"{found.external}.{part}")
        return None

    def class_names(self, cls: Found) -> set[str]:
        """Every member name of a class: its own and its bases' (bases outside the wheel are imported;
        a base the wheel's sources cannot show, such as a C extension type, adds nothing)."""
        names = set()
        for node in cls.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
        for base in self.bases(cls):
            if base.kind == "class":
                names |= self.class_names(base)
            elif base.kind == "external":
                try:
                    names |= set(dir(live_lookup(base.external)))
                except (ImportError, AttributeError):
                    pass
        return names

    def signature(self, found: Found) -> inspect.Signature | None:
        """The call signature of a ``def`` or a class (None when the sources cannot show it)."""
        if found.kind == "def":
            return _signature(found.node.args)
        if found.kind == "class":
            for method in ("__init__", "__new__"):
                member = self.member(found, method)
                if member is not None and member.kind == "def":
                    return _drop_first(_signature(member.node.args))
                if member is not None and member.kind == "external":
                    sig = live_signature(member.external)
                    return _drop_first(sig) if sig is not None else None
            return None
        if found.kind == "external":
            return live_signature(found.external)
        return None

    def calls_in(self, found: Found) -> set[str]:
        """The names a ``def`` calls (``x._lazy_init()`` -> "_lazy_init")."""
        names = set()
        for node in ast.walk(found.node):
            if isinstance(node, ast.Call):
                chain = _dotted(node.func)
                if chain:
                    names.add(chain.rpartition(".")[2])
        return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


_MISSING = object()


def _signature(args: ast.arguments) -> inspect.Signature:
    """An ``inspect.Signature`` of an ast ``arguments`` node (defaults stand in as a marker)."""
    P = inspect.Parameter
    params = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [_MISSING] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if default is _MISSING else "<default>"))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else "<default>"))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _drop_first(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def live_lookup(dotted: str) -> Any:
    """Import the longest importable prefix of ``dotted`` and get the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"nothing of {dotted} can be imported")


def live_signature(dotted_or_obj: Any) -> inspect.Signature | None:
    obj = live_lookup(dotted_or_obj) if isinstance(dotted_or_obj, str) else dotted_or_obj
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # a C function without a text signature: only its existence is known


def accepts(sig: inspect.Signature, positional: int, keywords: frozenset[str] | set[str]) -> bool:
    """Does a call with ``positional`` positional arguments and ``keywords`` bind to ``sig``?"""
    try:
        sig.bind(*([None] * positional), **{k: None for k in keywords})
    except TypeError:
        return False
    return True


def shape(sig: inspect.Signature) -> list[tuple[str, Any, bool]]:
    """What two signatures must share to be called alike: each parameter's name, kind and whether it
    has a default (default values and annotations may differ)."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]
