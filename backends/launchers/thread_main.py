"""A ``__main__`` of its own for each replica thread that runs the user's script (XLA:CPU).

``runpy`` runs a script in a fresh module, puts that module in ``sys.modules["__main__"]`` while the
script runs, and puts the old entry back when it returns. Replica threads of one process running the
same script at once overwrite each other's entry and restore it under each other, so whatever looks a
name up in ``__main__`` finds another replica's object, or none: pickle, for one, failed to save a
``TrainingArguments`` subclass defined in the script (the Trainer saves its arguments with
``torch.save``) once the other replica had returned.

Here ``sys.modules["__main__"]`` becomes one module (``ThreadMain``) for the rest of the process, whose
attributes are those of the calling thread's own script module; a thread that runs no script (the
spawner's, or one a replica started) sees the original ``__main__``.
"""

from __future__ import annotations

import builtins
import io
import sys
import threading
import types
from typing import Any

_lock = threading.Lock()


#: the module attributes that describe the script, answered from the calling thread's own module
_DESCRIBING = frozenset({"__file__", "__spec__", "__loader__", "__package__", "__cached__", "__doc__"})


class ThreadMain(types.ModuleType):
    """``sys.modules["__main__"]`` while replica threads run scripts: each thread sees its own."""

    def __init__(self, original: types.ModuleType) -> None:
        super().__init__("__main__")
        self._xshard_original = original
        self._xshard_by_thread: dict[int, types.ModuleType] = {}

    def _current(self) -> types.ModuleType:
        return self._xshard_by_thread.get(threading.get_ident(), self._xshard_original)

    def __getattribute__(self, name: str) -> Any:
        if name in _DESCRIBING:
            return getattr(types.ModuleType.__getattribute__(self, "_current")(), name)
        return types.ModuleType.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:  # a name this module does not hold: the thread's script's
        return getattr(self._current(), name)


def _proxy() -> ThreadMain:
    with _lock:
        main = sys.modules["__main__"]
        if not isinstance(main, ThreadMain):
            main = ThreadMain(main)
            sys.modules["__main__"] = main
        return main


def run_path(path: str) -> None:
    """Run the script at ``path`` as ``__main__`` in this thread (``runpy.run_path`` for one thread)."""
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec")
    _run(code, {"__file__": path, "__cached__": None, "__loader__": None, "__package__": None, "__spec__": None})


def run_module(name: str) -> None:
    """Run module ``name`` as ``__main__`` in this thread (``runpy.run_module(..., alter_sys=True)``)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"No module named {name!r}")
    if spec.submodule_search_locations is not None:  # a package: run its __main__, as python -m does
        spec = importlib.util.find_spec(f"{name}.__main__")
        if spec is None or spec.loader is None:
            raise ImportError(f"No module named {name}.__main__; {name!r} is a package and cannot be executed")
    loader = spec.loader
    get_code = getattr(loader, "get_code", None)
    code = get_code(spec.name) if get_code is not None else None
    if code is None:
        raise ImportError(f"No code object available for {name!r}")
    _run(code, {"__file__": spec.origin, "__cached__": spec.cached, "__loader__": loader,
                "__package__": spec.parent, "__spec__": spec})


def _run(code: types.CodeType, attributes: dict[str, Any]) -> None:
    proxy = _proxy()
    module = types.ModuleType("__main__")
    module.__dict__.update(attributes, __builtins__=builtins)
    ident = threading.get_ident()
    proxy._xshard_by_thread[ident] = module
    try:
        exec(code, module.__dict__)
    finally:
        del proxy._xshard_by_thread[ident]
