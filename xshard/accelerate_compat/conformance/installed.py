"""The installed accelerate's public surfaces, enumerated (``installed()``).

A member is public when its name does not start with ``_``. Each surface is what a script can reach:

- ``accelerate.Accelerator``: the class's members (methods, properties) and the attributes a real
  ``Accelerator(cpu=True)`` sets in ``__init__`` (built in this process, one CPU process);
- the prepared optimizer and scheduler: ``AcceleratedOptimizer`` / ``AcceleratedScheduler``'s members and the
  attributes ``prepare`` sets on them;
- the prepared loader: ``DataLoaderShard``'s members (its own, ``DataLoaderAdapter``'s and
  ``DataLoaderStateMixin``'s), the attributes ``prepare`` sets on it, and torch ``DataLoader``'s members and
  attributes, which it hands on from the DataLoader it wraps;
- ``accelerate.utils``: it has no ``__all__``, so its surface is every public name that is not a submodule (the
  names ``from accelerate.utils import X`` finds);
- the plugin, ``*Kwargs`` and ``*Configuration`` constructors: the public ``dataclasses.fields`` of
  ``accelerate.utils``' dataclasses whose names end in ``Plugin``, ``Kwargs`` or ``Configuration``
  (``ProjectConfiguration``, ``DataLoaderConfiguration``), as ``"Class.field"``.

Builds Accelerate's own Accelerator: call it in a process of its own (``python -m
xshard.accelerate_compat.conformance``), never beside a job.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any


def _public(names: Any) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def installed() -> tuple[dict[str, list[str]], str]:
    """The installed accelerate's members, surface title (``conformance.SURFACES``) -> sorted names, and its
    version."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from . import SURFACES

    # imported by name: accelerate is the reference read here, never a dependency xshard's types rely on
    accelerate, utils = importlib.import_module("accelerate"), importlib.import_module("accelerate.utils")
    DataLoaderShard = importlib.import_module("accelerate.data_loader").DataLoaderShard
    AcceleratedOptimizer = importlib.import_module("accelerate.optimizer").AcceleratedOptimizer
    AcceleratedScheduler = importlib.import_module("accelerate.scheduler").AcceleratedScheduler

    acc = accelerate.Accelerator(cpu=True)
    optimizer = acc.prepare(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    scheduler = acc.prepare(torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1))
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2))
    plugins = {
        name: _public(f.name for f in dataclasses.fields(cls))
        for name, cls in vars(utils).items()
        if not name.startswith("_") and name.endswith(("Plugin", "Kwargs", "Configuration")) and inspect.isclass(cls)
        and dataclasses.is_dataclass(cls)
    }
    members = {
        "accelerate.Accelerator": _public(dir(accelerate.Accelerator)) | _public(vars(acc)),
        "AcceleratedOptimizer (the prepared optimizer)": _public(dir(AcceleratedOptimizer)) | _public(vars(optimizer)),
        "AcceleratedScheduler (the prepared scheduler)": _public(dir(AcceleratedScheduler)) | _public(vars(scheduler)),
        "DataLoaderShard (the prepared data loader)": _public(dir(DataLoaderShard)) | _public(vars(loader))
        | _public(dir(DataLoader)) | _public(vars(loader.base_dataloader)),
        "accelerate.utils": {name for name in _public(dir(utils)) if not inspect.ismodule(getattr(utils, name))},
        "Plugin, *Kwargs and *Configuration fields": {f"{owner}.{name}" for owner, fields in plugins.items() for name in fields},
    }
    acc.end_training()
    assert set(members) == {s.title for s in SURFACES}
    return {title: sorted(names) for title, names in members.items()}, accelerate.__version__
