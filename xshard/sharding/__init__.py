"""The sharded data-parallel core: ZeRO stages 0-3 (FSDP NO_SHARD / SHARD_GRAD_OP / FULL_SHARD).

``shard_model(module, backend, ShardingOptions(...))`` returns a ``ShardedModel``. It uses only the
backend's collectives, its compute device and a few backend attributes, so it runs unchanged on
every backend. Files, one job each:

- ``options``: ShardingOptions and stage names
- ``wrap``: auto-wrap policies, units, tied weights
- ``layout``: per-parameter dim-0 shard geometry and flat buffers
- ``unit``: a unit's shards, full copies, all-gather and reduce-scatter
- ``engine``: hooks, prefetch and the end-of-backward callback (stages 1-3)
- ``replicate``: stage 0, bucketed all-reduce
- ``precision``, ``grad_clip``, ``scaler``, ``state_dict``, ``stats``
- ``model``: ShardedModel and shard_model
"""

from .model import ShardedModel, shard_model
from .options import ShardingOptions, normalise_stage
from .scaler import ShardedGradScaler

__all__ = ["ShardedGradScaler", "ShardedModel", "ShardingOptions", "normalise_stage", "shard_model"]
