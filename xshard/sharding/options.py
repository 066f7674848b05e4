"""ShardingOptions: every knob of the sharded core, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xshard.errors import XShardError

#: Every name of a sharding strategy (FSDP's and ZeRO's, any case) -> (ZeRO stage, hybrid?). Hybrid
#: strategies shard within each node and replicate across nodes (``shard_group_size`` "node"). The one
#: table of these names: ``xshard.config`` asks it too (``xshard.sharding`` imports nothing of the config,
#: and ``ShardingOptions`` takes the names itself, so the table lives here).
STRATEGIES: dict[str, tuple[int, bool]] = {
    "NO_SHARD": (0, False),
    "DDP": (0, False),
    "OPTIMIZER_STATE": (1, False),
    "SHARD_GRAD_OP": (2, False),
    "FULL_SHARD": (3, False),
    "HYBRID_SHARD": (3, True),
    "HYBRID_SHARD_ZERO2": (2, True),
    "_HYBRID_SHARD_ZERO2": (2, True),
}
#: FSDP / ZeRO names accepted for ``stage``
STAGE_NAMES: dict[str, int] = {name: stage for name, (stage, hybrid) in STRATEGIES.items() if not hybrid}
#: FSDP's hybrid strategies: the stage, sharded within a node and replicated across nodes
HYBRID_NAMES: dict[str, int] = {name: stage for name, (stage, hybrid) in STRATEGIES.items() if hybrid}
#: ``shard_group_size`` value meaning "the processes of one node" (LOCAL_WORLD_SIZE)
NODE = "node"
#: the words ``shard_group_size`` takes besides a number of ranks (any case): every rank in one group (None),
#: or one node's processes; the config's readers ask this table too
GROUP_SIZE_NAMES: dict[str, str | None] = {"": None, "none": None, "null": None, "world": None, "node": NODE,
                                           "local_world_size": NODE}
WRAP_POLICIES = ("transformer", "size", "none")
#: every spelling of ``backward_prefetch`` (FSDP's BACKWARD_PRE / BACKWARD_POST / NO_PREFETCH, any case) -> its
#: value; the config's readers ask this table too
BACKWARD_PREFETCH_NAMES: dict[str, str] = {"pre": "pre", "backward_pre": "pre", "post": "post",
                                           "backward_post": "post", "none": "none", "no_prefetch": "none"}
BACKWARD_PREFETCH = tuple(dict.fromkeys(BACKWARD_PREFETCH_NAMES.values()))


class ShardingOptionsError(XShardError, ValueError):
    """A sharding option, or a combination of them, is not valid; ``fields`` names the options involved
    (the config's fields of the same names, so the config can say where each was set)."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


def strategy(name: str) -> tuple[int, bool] | None:
    """(stage, hybrid?) of a sharding strategy's name (any case; `STRATEGIES`), or None for another word."""
    return STRATEGIES.get(name.strip().upper())


def normalise_stage(stage: int | str) -> int:
    """0-3 from an int, a digit string, or an FSDP name (NO_SHARD=0, SHARD_GRAD_OP=2, FULL_SHARD=3)."""
    expected = f"stage={stage!r} is not valid: use one of 0, 1, 2, 3 or {sorted(STAGE_NAMES)}"
    if isinstance(stage, bool):
        raise ShardingOptionsError(expected, ("stage",))
    if isinstance(stage, int) and stage in (0, 1, 2, 3):
        return stage
    if isinstance(stage, str):
        key = stage.strip().upper()
        if key in ("0", "1", "2", "3"):
            return int(key)
        if key in STAGE_NAMES:
            return STAGE_NAMES[key]
    raise ShardingOptionsError(expected, ("stage",))


def _group_size(value: int | str | None) -> int | str | None:
    """``shard_group_size`` normalised: None, "node" or a positive int."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in GROUP_SIZE_NAMES:
            return GROUP_SIZE_NAMES[text]
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShardingOptionsError(f"shard_group_size={value!r} is not valid: use None (every rank), 'node' (the "
                                   "processes of one node) or a positive number of ranks that divides the world size",
                                   ("shard_group_size",))
    return value


def _check_dtype(name: str, value: torch.dtype | None) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ShardingOptionsError(f"{name}={value!r} is not a floating-point torch dtype (e.g. torch.bfloat16) or "
                                   "None", (name,))


@dataclass
class ShardingOptions:
    """How ``shard_model`` splits, shards, overlaps and casts a model.

    stage: 0 replicate (DDP), 1 optimizer state sharded, 2 + gradients sharded (SHARD_GRAD_OP),
        3 + parameters sharded (FULL_SHARD). FSDP names are accepted.
    auto_wrap_policy: "transformer" (units = modules whose class name is in
        ``transformer_layer_cls_to_wrap``, default ``model._no_split_modules``), "size" (units by
        ``min_num_params``) or "none" (one unit). The root unit holds what no other unit holds.
    backward_prefetch: "pre" gathers the next unit before computing this unit's gradients, "post"
        after, "none" only when needed. ``forward_prefetch`` (default on) gathers the next unit
        before this unit's forward runs: at stage 3 on 2 gloo ranks it cut the time blocked on
        all-gathers by about two thirds at no CPU cost (benchmarks/sharding_vs_peers.py --profile). ``max_inflight_all_gathers`` bounds the units gathered at once
        (stage 3: non-root units holding full parameters; stages 1-2: gathers in flight).
    param_dtype / reduce_dtype / buffer_dtype: compute (and all-gather) dtype, gradient
        reduce dtype (default: param_dtype at stages 1-3, the gradient's own at stage 0 as DDP),
        buffer dtype; None keeps the model's dtype. The
        user's parameters keep their dtype (fp32 master shards that the optimizer steps).
    autocast: the forward runs under the backend's autocast in ``param_dtype`` (default on), so
        numerically sensitive ops (softmax, norms, losses) stay in fp32 as with torch.autocast;
        at stage 0, which has no compute copies, it is what applies ``param_dtype``.
    output_dtype: floating outputs of the model's forward are cast to this dtype (e.g. fp32, as
        Accelerate returns them); None leaves them as computed.
    keep_norms_fp32: norm layers compute in fp32 (their parameters are gathered in fp32).
    shard_group_size: hybrid sharding (FSDP's HYBRID_SHARD, DeepSpeed's MiCS): parameters,
        gradients and optimizer state are sharded within groups of this many consecutive ranks and
        replicated across the groups; all-gathers and reduce-scatters stay inside a group and the
        reduced gradient shards are averaged across groups with one all-reduce each. None: one
        group of every rank (plain ZeRO / FULL_SHARD); "node": the processes of one node
        (LOCAL_WORLD_SIZE, as torchrun and ``xshard launch`` set it); an int must divide the world
        size. The FSDP names HYBRID_SHARD (stage 3) and _HYBRID_SHARD_ZERO2 (stage 2) as ``stage``
        set it to "node" unless it is given.
    reshard_after_forward: what a unit keeps of its full parameters from its forward to its backward,
        as FSDP2's argument: True frees them (stage 3's default), False keeps them (stages 1-2's
        default; stage 3 with False is stage 2), an int ``k`` (a divisor of the shard group size)
        keeps a 1/k piece on each rank so that the backward all-gather runs within groups of ``k``
        consecutive ranks (a node: ZeRO++'s hpZ), for 1/k of the parameters held in between. None:
        the stage's default.
    offload_params / offload_optimizer: keep parameter shards, gradient shards and optimizer
        state in host memory (the optimizer steps on the CPU).
    activation_checkpointing: recompute each unit's activations in backward.
    sync_module_states: broadcast rank 0's parameters and buffers before sharding.
    state_dict_rank0_only: ``model.state_dict()`` gives whole tensors on rank 0 only (others get an
        empty dict, as PyTorch FSDP's ``rank0_only``), instead of on every rank: one host copy of the
        model per job rather than per rank, for models too large for that; save with
        ``is_main_process=...`` then.
    bucket_size_mb: all-reduce bucket size at stage 0.
    generate_gathers_once: ``generate()`` at stage 3 gathers the whole model once for the call (True),
        every unit at every decoding step (False), or once when the whole model fits in the device's
        free memory (None, the default; see ``xshard/sharding/generation.py``).
    """

    stage: int | str = 3
    shard_group_size: int | str | None = None
    reshard_after_forward: bool | int | None = None
    auto_wrap_policy: str = "transformer"
    transformer_layer_cls_to_wrap: list[str] | None = None
    min_num_params: int = 100_000_000
    backward_prefetch: str = "pre"
    forward_prefetch: bool = True
    max_inflight_all_gathers: int = 2
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    autocast: bool = True
    output_dtype: torch.dtype | None = None
    keep_norms_fp32: bool = False
    offload_params: bool = False
    offload_optimizer: bool = False
    activation_checkpointing: bool = False
    sync_module_states: bool = False
    state_dict_rank0_only: bool = False
    bucket_size_mb: float = 25
    generate_gathers_once: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> ShardingOptions:
        """Normalise and check every field and every rule between fields (the one place they are checked);
        raise ShardingOptionsError (a ValueError) naming the options and the valid values."""
        named = strategy(self.stage) if isinstance(self.stage, str) else None
        if named is not None and named[1]:  # a hybrid strategy: its stage, within each node
            if self.shard_group_size is None:
                self.shard_group_size = NODE
            self.stage = named[0]
        self.stage = normalise_stage(self.stage)
        self.shard_group_size = _group_size(self.shard_group_size)
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            if not isinstance(self.reshard_after_forward, int) or self.reshard_after_forward < 1:
                raise ShardingOptionsError(
                    f"reshard_after_forward={self.reshard_after_forward!r} is not valid: use True, False, None (the "
                    "stage's default) or a group size (an int that divides the shard group)", ("reshard_after_forward",))
        policy = str(self.auto_wrap_policy).strip().lower()
        if policy not in WRAP_POLICIES:
            raise ShardingOptionsError(f"auto_wrap_policy={self.auto_wrap_policy!r} is not valid: use one of "
                                       f"{WRAP_POLICIES}", ("auto_wrap_policy",))
        self.auto_wrap_policy = policy
        if isinstance(self.transformer_layer_cls_to_wrap, str):
            self.transformer_layer_cls_to_wrap = [
                s.strip() for s in self.transformer_layer_cls_to_wrap.split(",") if s.strip()
            ]
        prefetch = BACKWARD_PREFETCH_NAMES.get(str(self.backward_prefetch).strip().lower())
        if prefetch is None:
            raise ShardingOptionsError(
                f"backward_prefetch={self.backward_prefetch!r} is not valid: use one of {BACKWARD_PREFETCH}",
                ("backward_prefetch",))
        self.backward_prefetch = prefetch
        if self.generate_gathers_once is not None and not isinstance(self.generate_gathers_once, bool):
            raise ShardingOptionsError(f"generate_gathers_once={self.generate_gathers_once!r} is not valid: use True, "
                                       "False or None (once when the model fits)", ("generate_gathers_once",))
        for name, value, what in (("max_inflight_all_gathers", self.max_inflight_all_gathers, "at least 1"),
                                  ("min_num_params", self.min_num_params, "a positive number of parameters")):
            if int(value) < 1:
                raise ShardingOptionsError(f"{name}={value} must be {what}", (name,))
        if float(self.bucket_size_mb) <= 0:
            raise ShardingOptionsError(f"bucket_size_mb={self.bucket_size_mb} must be positive", ("bucket_size_mb",))
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if self.stage == 0:
            self._check_stage_0()
        return self

    def _check_stage_0(self) -> None:
        """What stage 0 (replicated parameters, no compute copies) cannot do."""
        if self.offload:
            raise ShardingOptionsError(
                "offload_params/offload_optimizer need stage 1, 2 or 3: stage 0 replicates everything on the device, "
                "so there is no shard to offload; raise stage or turn offload off",
                ("stage", "offload_params", "offload_optimizer"))
        if self.shard_group_size is not None or self.reshard_after_forward:
            raise ShardingOptionsError(
                "shard_group_size and reshard_after_forward need sharded parameters (stage 1, 2 or 3), but stage 0 "
                f"shards nothing (shard_group_size={self.shard_group_size!r}, reshard_after_forward="
                f"{self.reshard_after_forward!r}): raise stage (HYBRID_SHARD is 3, _HYBRID_SHARD_ZERO2 2) or leave "
                "them unset", ("stage", "shard_group_size", "reshard_after_forward"))
        if self.param_dtype is not None and not self.autocast:
            raise ShardingOptionsError(
                "stage 0 computes with the model's own parameters, so param_dtype takes effect only through autocast: "
                "keep autocast=True, or use stage 1-3 for compute copies", ("stage", "param_dtype", "autocast"))

    @property
    def offload(self) -> bool:
        """Master shards, gradient shards and optimizer state live in host memory."""
        return bool(self.offload_params or self.offload_optimizer)
