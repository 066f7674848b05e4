"""xshard: one PyTorch training script on CUDA, TPU, Ascend NPU, MPS or CPU, sharded (ZeRO 0-3).

The device layer lives in the repository's top-level ``backends/`` folder; ``xshard/backends`` is a link
to it (as DeepSpeed's ``deepspeed/accelerator`` is to its top-level ``accelerator/``), so a source
checkout, an editable install and a wheel all import it as ``xshard.backends``.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .runtime.launch_marker import watch_for_failures

watch_for_failures()  # under xshard launch: a failure in xshard's code is named as xshard's (launch_marker)


def __getattr__(name: str) -> Any:
    """Public names, imported on first use so that `import xshard` stays light (no torch import)."""
    if name == "Accelerator":
        from .accelerator import Accelerator

        return Accelerator
    if name == "XShardConfig":
        from .config import XShardConfig

        return XShardConfig
    if name in ("get_logger", "tqdm", "progress"):
        from .runtime import rank_logging as log

        return getattr(log, name)
    if name in _FROM_UTILS:
        from .accelerate_compat import utils

        return getattr(utils, name)
    if name == "skip_first_batches":
        from .runtime.data import skip_first_batches

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
