"""Accelerate's members of a prepared data loader (``accelerate.data_loader.DataLoaderShard``) that the
sharded loader does not need for itself.

``AccelerateLoaderMembers`` is a mixin of ``ShardedDataLoader`` (``xshard.runtime.data``). It reads only the
loader's public attributes (``loader``: the rebuilt torch DataLoader of this rank's batches, ``sampler``,
``num_replicas``, ``batch_size``, ``dataset``), so the data machinery stays in ``data.py`` and this file is
Accelerate's:

- the global batch (``total_batch_size``) and the dataset's length (``total_dataset_length``);
- torch ``DataLoader``'s own attributes, which Accelerate's loader hands on from the loader it wraps
  (``num_workers``, ``collate_fn``, ``drop_last`` ...): here read from the rebuilt DataLoader, which keeps
  the user's settings (only the batching changes);
- Accelerate's members that have no meaning on xshard raise an ``AttributeError`` naming xshard's way
  (``LOADER_MEMBERS``; kept here, not in ``accelerate_compat.missing``: the job machinery imports none of
  ``accelerate_compat``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

#: torch DataLoader's attributes a prepared loader hands on from the DataLoader it reads (Accelerate's
#: ``DataLoaderAdapter`` forwards every unknown name to its ``base_dataloader``; these are torch's own)
DATALOADER_ATTRIBUTES = ("num_workers", "collate_fn", "pin_memory", "pin_memory_device", "drop_last", "timeout",
                         "worker_init_fn", "prefetch_factor", "persistent_workers", "generator", "in_order",
                         "multiprocessing_context", "batch_sampler", "check_worker_number_rationality")

_ORDER = "each epoch's order comes from the Accelerator's seed and the epoch (loader.set_epoch(epoch))"

#: members of Accelerate's prepared loader that xshard's has not -> xshard's way
LOADER_MEMBERS: dict[str, str] = {
    "set_sampler": "build the DataLoader with that sampler and prepare it",
    "rng_types": _ORDER,
    "synchronized_generator": _ORDER,
    "gradient_state": "read accelerator.gradient_state",
    "begin": "iterating the loader registers it with accelerator.gradient_state (no call needed)",
    "end": "iterating the loader registers it with accelerator.gradient_state (no call needed)",
    "reset": "iterating the loader starts a new pass (end_of_dataloader False, remainder recomputed)",
    "adjust_state_dict_for_prefetch": "state_dict() counts the batches this rank used; nothing to adjust",
}


class AccelerateLoaderMembers:
    """Accelerate's ``DataLoaderShard`` members of a prepared loader (see the module docstring)."""

    if TYPE_CHECKING:  # the sharded loader's public attributes this mixin reads
        loader: DataLoader
        sampler: Any
        num_replicas: int

        @property
        def batch_size(self) -> int | None: ...

        @property
        def dataset(self) -> Any: ...

    @property
    def base_dataloader(self) -> DataLoader:
        """The torch DataLoader this loader reads (the user's, rebuilt to give this rank's batches)."""
        return self.loader

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes: the per-process batch times the number of processes."""
        return None if self.batch_size is None else self.batch_size * self.num_replicas

    @property
    def total_dataset_length(self) -> int:
        """The dataset's length (its ``total_length`` where it has one, as Accelerate reads it)."""
        return int(getattr(self.dataset, "total_length", None) or len(self.dataset))

    @property
    def use_stateful_dataloader(self) -> bool:
        """Always True: the loader has ``state_dict()`` / ``load_state_dict()`` and ``save_state`` keeps its
        position."""
        return True

    def get_sampler(self) -> Any:
        """The sampler of this rank's batches (xshard's: each epoch's order from the Accelerator's seed, or the
        loader's own generator, dealt over the ranks), where Accelerate returns the sampler it wraps."""
        return self.sampler

    def __getattr__(self, name: str) -> Any:
        # only reached for names not found: torch DataLoader's attributes come from the rebuilt loader, the
        # Accelerate members xshard lacks get xshard's way
        if name in DATALOADER_ATTRIBUTES:
            return getattr(self.loader, name)
        if name in LOADER_MEMBERS:
            raise AttributeError(f"DataLoader.{name} is Accelerate's; xshard's prepared loader does not have it: "
                                 f"{LOADER_MEMBERS[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
