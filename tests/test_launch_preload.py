"""Replica threads find a script's third-party imports done (the xla launcher's ``preload_imports``).

A lazy package (a module ``__getattr__`` that imports a submodule on first access, as transformers
does) imported by two replica threads at once can fail in one of them. The launcher imports what the
script and its own modules import from other packages, once per process, before running it.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import pytest

from xshard.backends.launchers.preload import preload_imports, third_party_imports

LAZY_PACKAGE = '''
import importlib, time
loads = []
def __getattr__(name):
    if name == "Tokenizer":
        loads.append(name)
        time.sleep(0.2)  # a slow submodule import: the window in which a second thread would race
        return importlib.import_module(".tokenizer", __name__).Tokenizer
    raise AttributeError(name)
'''


@pytest.fixture
def lazy_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"lazypkg_{tmp_path.name.replace('-', '_')}"
    pkg = tmp_path / "site" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(LAZY_PACKAGE)
    (pkg / "tokenizer.py").write_text("class Tokenizer:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield name
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def _script(tmp_path: Path, package: str) -> Path:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "ownmodule.py").write_text(textwrap.dedent(f"""
        import json
        def build():
            from {package} import Tokenizer  # a lazy import inside a function, in the script's own module
            return Tokenizer()
        """))
    script = folder / "train.py"
    script.write_text("from __future__ import annotations\nimport ownmodule\nimport os.path\n")
    return script


def test_the_imports_of_the_script_and_its_own_modules_are_found_not_its_modules(tmp_path, lazy_package) -> None:
    found = dict(third_party_imports(_script(tmp_path, lazy_package)))
    assert found[lazy_package] == ("Tokenizer",) and "json" in found and "os.path" in found
    assert "ownmodule" not in found and "__future__" not in found  # the script's own module runs when it says


def test_replica_threads_resolve_a_lazy_package_once_before_running(tmp_path, lazy_package) -> None:
    script = _script(tmp_path, lazy_package)
    threads = [threading.Thread(target=preload_imports, args=(script,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    package = sys.modules[lazy_package]
    assert package.loads == ["Tokenizer"]  # one thread did it; the others waited and found it done
    assert f"{lazy_package}.tokenizer" in sys.modules
    assert "ownmodule" not in sys.modules
