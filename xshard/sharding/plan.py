"""ShardingPlan: the ZeRO stage translated, once, into independent policies.

Everything below the plan (units, engines, state dicts, accounting) reads these policies and never
the stage number, so a new combination (e.g. hybrid sharding, partial resharding) is a new plan, not
a new branch in twenty places. The translation, as PyTorch FSDP2 describes the same strategies:

    stage  parameters held by a rank      full copies after forward   gradients reduced by    when
    0      whole (replicated)             n/a (the parameters)        all-reduce (buckets)    as buckets fill
    1      dim-0 shard (+ full copy)      kept                        reduce-scatter          end of backward
    2      dim-0 shard (+ full copy)      kept                        reduce-scatter          per unit
    3      dim-0 shard                    freed                       reduce-scatter          per unit

Stage 0 has no compute copies: the model computes with the user's parameters and mixed precision
comes from autocast alone, as with DDP. Stages 1-3 compute with full copies in ``param_dtype``
(gathered in that dtype, half the bytes for bf16), under the same autocast.

Two more policies are orthogonal to the stage:

- ``shard_group_size`` (hybrid sharding, FSDP's HYBRID_SHARD / HSDP, DeepSpeed's MiCS): stages 1-3
  shard over groups of G consecutive ranks (a node) instead of the whole world and replicate across
  the W / G groups. A unit's all-gather and reduce-scatter stay inside its group; the reduced
  gradient shard is then averaged across groups (one all-reduce per unit over the rank's replica
  group: the ranks holding the same rows). Every rank thus sends psi-sized all-gathers and
  reduce-scatters over the fast intra-node links and only 2 psi / G over the inter-node network.
- ``reshard_after_forward`` (FSDP2's, a ``ReshardAfterForward``): whether full copies are freed after
  forward, and whether backward gathers them back from the shard group or from a smaller group of
  consecutive ranks that kept 1/k each (FSDP2's int, ZeRO++ hpZ).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .options import ShardingOptions


class GradReduction(enum.Enum):
    """How a rank's gradients become the average over ranks."""

    #: every rank keeps the whole average (replicated parameters)
    ALL_REDUCE = "all_reduce"
    #: each rank keeps the average of its own shard
    REDUCE_SCATTER = "reduce_scatter"


class ReduceTiming(enum.Enum):
    """When gradients are reduced during backward."""

    #: each unit (or bucket) as soon as its gradients are complete, overlapping the rest of backward
    AS_READY = "as_ready"
    #: all at once when backward has finished
    END_OF_BACKWARD = "end_of_backward"


@dataclass(frozen=True)
class PrecisionPolicy:
    """The sharded core's mixed-precision policy: which dtype each tensor takes (built from the options).

    The job's precision (its name, autocast, backward and the fp16 scaler) is ``xshard.runtime.mixed_precision.Precision``,
    outside the core; it sets ``output_dtype`` through the options.

    param_dtype: dtype of the full compute copies (stages 1-3) and of autocast; None: the model's.
    reduce_dtype: dtype gradients are reduced in; None: param_dtype at stages 1-3 (FSDP's MixedPrecision;
        else the gradient's own), the gradient's own at stage 0 (DDP's fp32 gradients under autocast).
    buffer_dtype: dtype floating buffers are cast to; None: unchanged.
    output_dtype: dtype floating outputs of the root forward are cast to; None: unchanged.
    autocast: run the forward under the backend's autocast in param_dtype (softmax, norms and losses
        then stay in fp32, as with torch.autocast).
    keep_norms_fp32: norm layers compute in fp32 (and their parameters are gathered in fp32).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    autocast: bool = True
    keep_norms_fp32: bool = False

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward runs under autocast in, or None for no autocast."""
        if not self.autocast or self.param_dtype in (None, torch.float32):
            return None
        return self.param_dtype


@dataclass(frozen=True)
class ReshardAfterForward:
    """What a unit keeps of its full parameters from its forward to its backward.

    frees: the full copies are freed after forward and gathered again for backward (stage 3; FSDP2's
        ``True``); False: they stay resident until the shards change (stages 1-2; FSDP2's ``False``).
    post_forward_group_size: when freeing, each rank first keeps a 1/k piece of the full copies (k =
        this size, a divisor of the shard group size), so the backward all-gather runs within groups
        of k consecutive ranks (a node) instead of the whole shard group (FSDP2's int, ZeRO++'s hpZ).
        None: backward gathers from the shards, over the shard group.
    """

    frees: bool
    post_forward_group_size: int | None = None


@dataclass(frozen=True)
class ShardingPlan:
    """What a sharded model does, policy by policy (see the module docstring).

    stage: the ZeRO stage this plan was made from, for reports only.
    world_size: ranks of the job.
    shard_parameters: the user's Parameters hold dim-0 shards and full compute copies are gathered
        for forward and backward; False: parameters stay whole on every rank (replicated).
    shard_group_size: ranks one parameter is sharded over (consecutive global ranks); the world
        size unless hybrid sharding, 1 at stage 0. ``replicas`` = world_size / shard_group_size.
    reshard_after_forward: see ``ReshardAfterForward``.
    grad_reduction, reduce_timing: how and when gradients are averaged (REDUCE_SCATTER within the
        shard group, followed by an all-reduce across replicas when there are several).
    offload: shards, gradient shards and optimizer state live in host memory.
    precision: the mixed-precision policy.
    """

    stage: int
    world_size: int
    shard_parameters: bool
    shard_group_size: int
    reshard_after_forward: ReshardAfterForward
    grad_reduction: GradReduction
    reduce_timing: ReduceTiming
    offload: bool
    precision: PrecisionPolicy

    def __post_init__(self) -> None:
        # the two engines: sharded parameters with reduce-scattered gradients, whole ones all-reduced
        if self.shard_parameters != (self.grad_reduction is GradReduction.REDUCE_SCATTER):
            raise ValueError(f"a plan with shard_parameters={self.shard_parameters} reduces gradients by "
                             f"{self.grad_reduction.name}: sharded parameters reduce-scatter, whole ones all-reduce")

    @property
    def replicas(self) -> int:
        """Copies of every shard in the job (one per shard group)."""
        return self.world_size // self.shard_group_size

    def describe(self) -> str:
        """One line for the log: the stage and what it means on this job (groups, resharding, offload)."""
        if not self.shard_parameters:
            return f"stage {self.stage}: replicated on {self.world_size} rank(s), gradients all-reduced"
        where = (f"sharded over all {self.world_size} rank(s)" if self.replicas == 1 else
                 f"sharded within groups of {self.shard_group_size} rank(s), {self.replicas} replicas (hybrid)")
        reshard = self.reshard_after_forward
        kept = ("freed after forward" if reshard.frees and reshard.post_forward_group_size is None else
                (f"freed after forward but for 1/{reshard.post_forward_group_size} on each rank (backward gathers "
                 f"within groups of {reshard.post_forward_group_size})") if reshard.frees else
                "kept from forward to backward")
        return (f"stage {self.stage}: parameters {where}; full copies {kept}"
                + ("; shards and optimizer state offloaded to the host" if self.offload else ""))

    @classmethod
    def for_stage(cls, stage: int | str) -> ShardingPlan:
        """The plan of ZeRO stage ``stage`` with every other option at its default, on one rank (for
        code that only needs to know what a stage does: config checks, estimates, reports)."""
        return cls.from_options(ShardingOptions(stage=stage))

    @classmethod
    def from_options(cls, options: ShardingOptions, world_size: int = 1,
                     local_world_size: int | None = None) -> ShardingPlan:
        """The plan for ``options`` on ``world_size`` ranks, ``local_world_size`` per node (the only
        place that reads ``options.stage``)."""
        options.validate()  # every rule between options, the stage-0 ones included, is checked there
        stage = int(options.stage)
        precision = PrecisionPolicy(
            param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype, buffer_dtype=options.buffer_dtype,
            output_dtype=options.output_dtype, autocast=options.autocast, keep_norms_fp32=options.keep_norms_fp32,
        )
        group = _shard_group_size(options.shard_group_size, world_size, local_world_size)
        if stage == 0:
            return cls(stage, world_size, shard_parameters=False, shard_group_size=1,
                       reshard_after_forward=ReshardAfterForward(False),
                       grad_reduction=GradReduction.ALL_REDUCE, reduce_timing=ReduceTiming.AS_READY,
                       offload=False, precision=precision)
        return cls(stage, world_size, shard_parameters=True, shard_group_size=group,
                   reshard_after_forward=_reshard(options.reshard_after_forward, stage, group),
                   grad_reduction=GradReduction.REDUCE_SCATTER,
                   reduce_timing=ReduceTiming.END_OF_BACKWARD if stage == 1 else ReduceTiming.AS_READY,
                   offload=options.offload, precision=precision)


def _shard_group_size(value: int | str | None, world_size: int, local_world_size: int | None) -> int:
    """Ranks per shard group: the world (None), one node's processes ("node"), or a divisor of the world."""
    if value is None:
        return world_size
    if value == "node":
        local = world_size if local_world_size is None else int(local_world_size)
        if local < 1 or world_size % local:
            raise ValueError(f"shard_group_size='node' needs the same number of processes on every node, but "
                             f"LOCAL_WORLD_SIZE={local} does not divide WORLD_SIZE={world_size}: start as many "
                             "processes on each node, or give shard_group_size as a number of ranks")
        return local
    size = int(value)
    if size > world_size or world_size % size:
        raise ValueError(f"shard_group_size={size} must divide the world size {world_size} (groups of consecutive "
                         f"ranks, one per node usually): use a divisor of {world_size}, 'node', or None")
    return size


def _reshard(value: bool | int | None, stage: int, group: int) -> ReshardAfterForward:
    """The reshard policy: the stage's default (stage 3 frees), or FSDP2's True / False / int."""
    if value is None:
        return ReshardAfterForward(stage == 3)
    if isinstance(value, bool):
        return ReshardAfterForward(value)
    if group % value:
        raise ValueError(f"reshard_after_forward={value} must divide the shard group size {group} (post-forward "
                         f"groups of consecutive ranks inside a shard group): use a divisor of {group}, True or False")
    if value == 1:  # a group of one keeps the whole parameter: FSDP2's False
        return ReshardAfterForward(False)
    if value == group:  # the whole shard group: FSDP2's True
        return ReshardAfterForward(True)
    return ReshardAfterForward(True, post_forward_group_size=value)
