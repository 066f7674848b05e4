"""Every attribute of the ``Accelerator`` is born in its ``__init__``, with a type.

A reader (or an editor) sees the object's whole state in one place; an attribute first assigned in
some later method exists on some Accelerators and not others, depending on which calls ran. Read
with ``ast`` from the source, as ``tests/test_import_graph.py`` reads imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "xshard" / "accelerator.py"
#: Accelerate's surface, a mixin of the Accelerator: its own state is declared on the class, with a type
SURFACE = Path(__file__).resolve().parent.parent / "xshard" / "accelerate_compat" / "accelerator_surface.py"


def _self_targets(node: ast.AST) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    return [e.attr for t in targets for e in ast.walk(t)
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"]


def _class(source: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(source.read_text(encoding="utf-8"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _accelerator_methods() -> dict[str, ast.FunctionDef]:
    methods = {f.name: f for f in _class(SURFACE, "AccelerateSurface").body if isinstance(f, ast.FunctionDef)}
    methods.update({f.name: f for f in _class(SOURCE, "Accelerator").body if isinstance(f, ast.FunctionDef)})
    return methods


def _surface_declared() -> set[str]:
    """Attributes the surface declares on its class, with a type."""
    return {n.target.id for n in _class(SURFACE, "AccelerateSurface").body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_every_accelerator_attribute_is_born_in_init() -> None:
    methods = _accelerator_methods()
    born = {name for node in ast.walk(methods["__init__"]) for name in _self_targets(node)} | _surface_declared()
    later = {f"{method}: self.{name}" for method, f in methods.items() if method != "__init__"
             for node in ast.walk(f) for name in _self_targets(node) if name not in born}
    assert later == set(), "declare these attributes in Accelerator.__init__"
    assert {"job", "state", "gradient_state", "trackers", "project_configuration"} <= born


def test_every_accelerator_attribute_is_declared_with_a_type() -> None:
    init = _accelerator_methods()["__init__"]
    annotated = {e.attr for n in ast.walk(init) if isinstance(n, ast.AnnAssign)
                 for e in [n.target] if isinstance(e, ast.Attribute)}
    born = {name for node in ast.walk(init) for name in _self_targets(node)}
    assert born - annotated == set(), "give these attributes a type where Accelerator.__init__ assigns them"
