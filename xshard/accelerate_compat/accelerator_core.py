"""What Accelerate's extra surface asks of the core ``Accelerator``: a Protocol, so the surface is typed
without importing the user API (``tests/test_import_graph.py`` keeps that direction).

The core (``xshard/accelerator.py``) is the Accelerator xshard needs to train: init, ``prepare``, the step
(``backward``, clipping, accumulation), ``gather``/``reduce``, ``save_state``/``load_state``. Everything a
script written for Accelerate also reaches (process helpers, trackers, ``save_model``, Accelerate's
properties) is ``xshard.accelerate_compat.accelerator_surface.AccelerateSurface``, built on these members only.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..backends import Backend
from ..config import XShardConfig
from ..config.accelerate_args import AccelerateSettings
from ..runtime.job import JobState
from .accelerator_state import AcceleratorState


class AcceleratorCore(Protocol):
    """The members of the core Accelerator that its Accelerate surface reads or sets."""

    #: the job's facts, prepared objects and step counters
    job: JobState
    backend: Backend
    config: XShardConfig
    #: Accelerate's ``AcceleratorState`` view of the job
    state: AcceleratorState
    #: Accelerate's ``ProjectConfiguration`` (xshard's or Accelerate's own class, read by its fields)
    project_configuration: Any
    #: the running trackers (main process) and the ones ``log_with`` chose
    trackers: list[Any]
    tracker_choice: list[Any]
    #: Accelerate's arguments the core was built with (its ``DataLoaderConfiguration`` values among them)
    accelerate_args: AccelerateSettings

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def is_main_process(self) -> bool: ...

    @property
    def is_local_main_process(self) -> bool: ...

    @property
    def compute_dtype(self) -> torch.dtype | None: ...

    @property
    def project_dir(self) -> str | None: ...

    def reduce(self, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any: ...

    def wait_for_everyone(self) -> None: ...

    def throughput(self) -> dict[str, Any]: ...

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]: ...

    def end(self) -> None: ...

    def close_models(self) -> None: ...
