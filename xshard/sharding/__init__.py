"""The sharded data-parallel core: ZeRO stages 0-3 (FSDP NO_SHARD / SHARD_GRAD_OP / FULL_SHARD).

``shard_model(module, backend, ShardingOptions(...))`` returns a ``ShardedModel``. It uses only the
backend's declared members (its collectives, compute device and capabilities), so it runs unchanged
on every backend. Files, one job each:

- ``options``: ShardingOptions, the user's knobs and stage names
- ``plan``: the stage translated once into independent policies (ShardingPlan); nothing else reads it
- ``wrap``: auto-wrap policies, units, tied weights
- ``layout``: ShardLayout, the one dim-0 shard geometry; flat buffer layouts; ShardedParamView
- ``params``: a parameter's two faces (the user's shard-holding Parameter, the full compute copy)
- ``unit``: a unit's state, all-gather and gradient reduce
- ``engine``: the engine interface; ``shard_engine`` (stages 1-3) and ``replicate`` (stage 0)
- ``groups``: the shard, replica and post-forward groups of hybrid sharding and reshard_after_forward=k
- ``sharded_init``: build a model in code with each rank holding only its rows of a normal init
- ``precision``, ``buffers``, ``grad_clip``, ``scaler``, ``state_dict``, ``stats``, ``materialize``
- ``model``: ShardedModel and shard_model
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .layout import ShardedParamView
from .options import ShardingOptions, normalise_stage
from .plan import GradReduction, PrecisionPolicy, ReduceTiming, ReshardAfterForward, ShardingPlan
from .scaler import ShardedGradScaler
from .sharded_init import sharded_init

if TYPE_CHECKING:
    from .model import ShardedModel, shard_model

# The model's names are imported on first use: its engines' hooks are ``torch.compiler.disable``d,
# which imports torch._dynamo (about 1.2 s), and the config reader and the CLI need only the options.
_FROM_MODEL = ("ShardedModel", "shard_model")


def __getattr__(name: str) -> Any:
    """``ShardedModel`` and ``shard_model``, imported from ``.model`` on first use."""
    if name not in _FROM_MODEL:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import model

    return getattr(model, name)


__all__ = ["GradReduction", "PrecisionPolicy", "ReduceTiming", "ShardedGradScaler", "ShardedModel", "ShardedParamView",
           "ReshardAfterForward", "ShardingOptions", "ShardingPlan", "normalise_stage", "shard_model", "sharded_init"]
