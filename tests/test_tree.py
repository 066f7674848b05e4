"""The source tree is the architecture: what sits at the top of ``xshard/``, which names repeat, what the wheel holds,
and the import paths users write, which no move may break.

``tests/test_import_graph.py`` checks who imports whom; this file checks where things are.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from test_suite_hygiene import PYPROJECT

from xshard.accelerate_compat import IMPORT_PATHS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xshard"

#: the top of xshard/: the user API (what a script calls) and nothing of the job machinery
USER_API_MODULES = {"__init__", "__main__", "_version", "accelerator", "pretrained", "estimate", "step_time",
                    "static_shapes", "errors"}

#: module names that appear twice, each pair one meaning seen from two layers (anything else is a collision)
SAME_MEANING = {
    "metrics": "Accelerate's import path and its implementation",
    "utils": "Accelerate's import path and its implementation",
    "tracking": "Accelerate's import path and its implementation",
    "estimate": "the `xshard estimate` command and the estimator",
    "consolidate": "the `xshard consolidate` command and the consolidation",
    "config": "the `xshard config` command and the Trainer arguments' config (xshard.config reads both)",
    "xla": "a device family and its launcher", "tpu": "a device family and its launcher",
    "base": "the Backend contract and the launcher contract",
    "single": "one process's collectives and one process's launcher",
    "__main__": "`python -m xshard` and `python -m xshard.accelerate_compat.conformance` (the tables' generator)",
    "accelerator": "the Accelerator and the conformance table of Accelerate's Accelerator",
}

#: the import paths the docs, the examples and Accelerate's users write: module -> names
PUBLIC_PATHS = {
    "xshard": ["Accelerator", "XShardConfig", "DistributedType", "get_logger", "progress", "tqdm",
               "skip_first_batches", "set_seed", "ProjectConfiguration", "DataLoaderConfiguration",
               "InitProcessGroupKwargs", "__version__"],
    "xshard.config": ["XShardConfig", "read_source"],
    "xshard.logging": ["get_logger"],
    "xshard.utils": ["set_seed", "ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin",
                     "DistributedType", "FullyShardedDataParallelPlugin", "DeepSpeedPlugin", "GradScalerKwargs"],
    "xshard.state": ["AcceleratorState", "GradientState", "DistributedType"],
    "xshard.tracking": ["TensorBoardTracker"],
    "xshard.metrics": ["pad_across_processes", "split_between_processes"],
    "xshard.pretrained": ["from_pretrained_sharded"],
    "xshard.static_shapes": ["PadToMultiple"],
    "xshard.trainer": ["Trainer", "TrainingArguments", "TrainerMixin", "TrainingArgumentsMixin", "sharding_config"],
    "xshard.backends": ["Backend", "World", "register_backend", "select"],
    "xshard.sharding": ["ShardedModel", "shard_model", "PrecisionPolicy", "ShardedGradScaler"],
    "xshard.checkpoint": ["latest_checkpoint", "CheckpointError"],
    "xshard.errors": ["XShardError"],
}


def _modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "backends" not in p.relative_to(PACKAGE).parts[:1]] + \
        list((ROOT / "backends").rglob("*.py"))


def test_the_top_of_the_package_is_the_user_api_and_accelerates_import_paths() -> None:
    top = {p.stem for p in PACKAGE.glob("*.py")}
    accelerate = {path.removeprefix("xshard.") for path in IMPORT_PATHS}
    assert top - USER_API_MODULES - accelerate == set(), "job machinery belongs in xshard/runtime/"


@pytest.mark.parametrize("path, implementation", sorted(IMPORT_PATHS.items()))
def test_each_accelerate_import_path_only_re_exports(path: str, implementation: str) -> None:
    source = PACKAGE / (path.removeprefix("xshard.") + ".py")
    body = [n for n in ast.parse(source.read_text()).body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # the docstring
    imports = [n for n in body if isinstance(n, ast.ImportFrom) and n.module != "__future__"]
    rest = [n for n in body if not isinstance(n, ast.ImportFrom)
            and not (isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["__all__"])]
    assert rest == [], f"{path} must only re-export {implementation}"
    assert [f"xshard.{n.module}" for n in imports] == [implementation]


def test_no_name_means_two_things() -> None:
    seen: dict[str, list[str]] = {}
    for path in _modules():
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert set(repeated) - set(SAME_MEANING) == set(), f"rename one of each: {repeated}"
    assert all(len(paths) == 2 for paths in repeated.values()), repeated


def test_the_wheel_holds_every_package() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")
               if "backends" not in p.relative_to(PACKAGE).parts[:1]}
    folders |= {"xshard." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "backends").rglob("__init__.py")}
    assert folders - listed == set(), "add these packages to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.parametrize("module", sorted(PUBLIC_PATHS))
def test_the_public_import_paths_hold(module: str) -> None:
    imported = importlib.import_module(module)
    assert [name for name in PUBLIC_PATHS[module] if not hasattr(imported, name)] == []
