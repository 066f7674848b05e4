"""xshard: one PyTorch training script on CUDA, TPU, Ascend NPU, MPS or CPU, sharded (ZeRO 0-3).

The device layer lives in the top-level ``backends/`` folder and installs as ``xshard.backends``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ._version import __version__


class _SourceTreeBackends(importlib.abc.MetaPathFinder):
    """Finds ``xshard.backends`` in a source tree's top-level ``backends/`` folder.

    Going through the import system (rather than executing the module by hand) keeps its module
    lock: replicas that are threads of one process (XLA:CPU) may import ``xshard.backends`` at the
    same moment, and each must wait until the module is complete.
    """

    def __init__(self, name: str, folder: Path) -> None:
        self.name, self.folder = name, folder

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)]
        )


def _bind_backends_from_source_tree() -> None:
    """Make ``import xshard.backends`` work from a source checkout that is not installed.

    An installed wheel or an editable install maps ``backends/`` to ``xshard.backends`` (see
    pyproject.toml). Running from the repository root without installing, Python finds
    ``xshard/`` but not ``xshard/backends``; bind the sibling folder under the right name instead.
    """
    here = Path(__file__).resolve().parent
    folder = here.parent / "backends"
    # A wheel installs the device layer inside the package (xshard/backends/). A source tree has it
    # beside xshard/: bind that sibling, so a checkout imported from its own folder uses its own
    # backends even where an editable install of another checkout maps the name elsewhere.
    in_source_tree = (folder / "base.py").is_file() and (here.parent / "pyproject.toml").is_file()
    if (here / "backends").is_dir() or (not in_source_tree and importlib.util.find_spec(f"{__name__}.backends")):
        return
    if not in_source_tree:
        return
    sys.meta_path.insert(0, _SourceTreeBackends(f"{__name__}.backends", folder))
    importlib.import_module(f"{__name__}.backends")  # bound as an attribute of xshard, as before


_bind_backends_from_source_tree()


def __getattr__(name: str) -> Any:
    """Public names, imported on first use so that `import xshard` stays light (no torch import)."""
    if name == "Accelerator":
        from .accelerator import Accelerator

        return Accelerator
    if name == "XShardConfig":
        from .config import XShardConfig

        return XShardConfig
    if name in ("get_logger", "tqdm", "progress"):
        from . import log

        return getattr(log, name)
    if name in _FROM_UTILS:
        from .accelerate_compat import utils

        return getattr(utils, name)
    if name == "skip_first_batches":
        from .data import skip_first_batches

        return skip_first_batches
    from .accelerate_compat.missing import MODULE_NAMES

    if name in MODULE_NAMES:
        raise AttributeError(f"module 'xshard' has no attribute {name!r} (Accelerate's `accelerate.{name}`): "
                             f"{MODULE_NAMES[name]}")
    raise AttributeError(f"module 'xshard' has no attribute {name!r}")


#: names ``from accelerate import ...`` gives that ``xshard.utils`` holds with Accelerate's meaning
_FROM_UTILS = ("AutocastKwargs", "DataLoaderConfiguration", "DeepSpeedPlugin", "DistributedDataParallelKwargs",
               "DistributedType", "FullyShardedDataParallelPlugin", "GradScalerKwargs", "InitProcessGroupKwargs",
               "ProjectConfiguration", "set_seed")
__all__ = ["Accelerator", "XShardConfig", "__version__", "get_logger", "progress", "skip_first_batches", "tqdm",
           *_FROM_UTILS]
