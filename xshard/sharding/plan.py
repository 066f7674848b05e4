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
class Precision:
    """Mixed-precision policy.

    param_dtype: dtype of the full compute copies (stages 1-3) and of autocast; None: the model's.
    reduce_dtype: dtype gradients are reduced in; None: param_dtype (else the gradient's own).
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
class ShardingPlan:
    """What a sharded model does, policy by policy (see the module docstring).

    stage: the ZeRO stage this plan was made from, for reports only.
    shard_parameters: the user's Parameters hold dim-0 shards and full compute copies are gathered
        for forward and backward; False: parameters stay whole on every rank (replicated).
    reshard_after_forward: full copies are freed after each unit's forward and gathered again for
        its backward; False: they stay resident and are refreshed when the shards change.
    grad_reduction, reduce_timing: how and when gradients are averaged.
    offload: shards, gradient shards and optimizer state live in host memory.
    precision: the mixed-precision policy.
    """

    stage: int
    shard_parameters: bool
    reshard_after_forward: bool
    grad_reduction: GradReduction
    reduce_timing: ReduceTiming
    offload: bool
    precision: Precision

    @classmethod
    def for_stage(cls, stage: int | str) -> ShardingPlan:
        """The plan of ZeRO stage ``stage`` with every other option at its default (for code that
        only needs to know what a stage does: config checks, estimates, reports)."""
        return cls.from_options(ShardingOptions(stage=stage))

    @classmethod
    def from_options(cls, options: ShardingOptions) -> ShardingPlan:
        """The plan for ``options`` (the only place that reads ``options.stage``)."""
        stage = int(options.stage)
        precision = Precision(
            param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype, buffer_dtype=options.buffer_dtype,
            output_dtype=options.output_dtype, autocast=options.autocast, keep_norms_fp32=options.keep_norms_fp32,
        )
        if stage == 0:
            if options.offload:
                raise ValueError("offload_params/offload_optimizer need stage 1, 2 or 3 (stage 0 replicates "
                                 "everything on the device): set stage >= 1 or turn offload off")
            if precision.param_dtype is not None and not precision.autocast:
                raise ValueError("stage 0 computes with the model's own parameters, so param_dtype takes effect "
                                 "only through autocast: keep autocast=True, or use stage 1-3 for compute copies")
            return cls(stage, shard_parameters=False, reshard_after_forward=False,
                       grad_reduction=GradReduction.ALL_REDUCE, reduce_timing=ReduceTiming.AS_READY,
                       offload=False, precision=precision)
        return cls(stage, shard_parameters=True, reshard_after_forward=stage == 3,
                   grad_reduction=GradReduction.REDUCE_SCATTER,
                   reduce_timing=ReduceTiming.END_OF_BACKWARD if stage == 1 else ReduceTiming.AS_READY,
                   offload=options.offload, precision=precision)
