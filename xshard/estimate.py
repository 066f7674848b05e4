"""How much memory each device needs for a training run: model states, transients, activations.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3.1 and table 1). With
``psi`` parameters, ``N`` data-parallel processes and mixed precision (bf16/fp16 parameters and
gradients, an fp32 master copy plus Adam's two moments: ``K = 12`` bytes per parameter):

    stage 0 (replicated)             (2 + 2 + K) psi
    stage 1 (optimizer sharded)      2 psi + 2 psi + K psi / N
    stage 2 (+ gradients sharded)    2 psi + (2 + K) psi / N
    stage 3 (+ parameters sharded)   (2 + 2 + K) psi / N

Pure fp32 training keeps fp32 parameters and gradients and Adam's two fp32 moments (no master
copy): 4 + 4 + 8 = 16 bytes per parameter, split the same way by stage.

On top of the model states a device holds, at stage 2 and 3, unsharded gradients of the unit being
reduced (and of the root unit: embeddings, final norm and head, whose gradients build up through the
whole backward); at stage 3 also the gathered parameters of the root unit and of
``max_inflight_all_gathers`` decoder layers (the current one and the prefetched one). The units are
the decoder layers, as the transformer auto-wrap policy makes them.

``offload`` (stages 1-3) moves the optimizer states with the fp32 master to the host, and the
gradient shards at stages 2-3 and the parameter shards at stage 3; transients and activations stay.

Activations are an estimate for a LLaMA/Qwen-style decoder (RMSNorm, rotary attention, gated MLP,
no dropout), counting what autograd keeps for the backward, in the bookkeeping of Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", whose GPT layer keeps
``s b h (34 + 5 a s / h)`` bytes). Per layer and token, in elements of the compute dtype:

    attention  2 h (norm input, output) + 2 q_dim (queries after rotary, attention output) + 2 kv_dim (K, V)
    MLP        2 h (norm input, output) + 4 i (gate, up, activation, product)

Fused attention (``sdpa``: flash or memory-efficient kernels) keeps no ``s x s`` matrix; ``eager``
attention adds ``a s^2 b`` fp32 softmax outputs and their compute-dtype copy. With activation
checkpointing only each layer's input (``s b h``) is kept, plus one layer's activations while it is
recomputed. The logits add ``s b V`` in the compute dtype, an fp32 copy and the fp32 log-softmax.
Not counted: the runtime's own context, workspaces and allocator fragmentation, hence
:data:`USABLE_FRACTION`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xshard.config.values import MAX_PROCESSES
from xshard.errors import XShardError
from xshard.sharding.options import ShardingOptions, normalise_stage
from xshard.sharding.plan import GradReduction, ReduceTiming, ShardingPlan

GB = 10**9
MB = 10**6
USABLE_FRACTION = 0.9  # a run "fits" when the estimate is at most 90% of the device memory
# the core's default bound on gathered units: the unit in use plus the prefetched one
MAX_INFLIGHT_ALL_GATHERS = ShardingOptions.max_inflight_all_gathers

# model_type -> (q/k/v bias, o_proj bias, per-head q/k norms); LLaMA's attention_bias overrides the biases.
DECODER_FAMILIES: dict[str, tuple[bool, bool, bool]] = {
    "llama": (False, False, False),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (False, False, True),
}
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


#: the most processes an estimate is made for (the configuration's bound): far above any cluster, far below where
#: the shards round to 0 bytes
MAX_NPROC = MAX_PROCESSES
#: the largest micro-batch (sequences per device) and sequence length (tokens) an estimate is made for
MAX_MICRO_BATCH, MAX_SEQ_LEN = 1 << 20, 1 << 24


class EstimateError(XShardError, ValueError):
    """Bad input to the estimator (missing file, unknown model type, bad option); the message says the fix."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state, and per activation element, for one training dtype
    (what the estimate needs of a precision; the job's precision itself is ``xshard.runtime.mixed_precision.Precision``)."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # K in the ZeRO paper
    activation_bytes: int


PRECISIONS = {
    "bf16": StateBytes("bf16", 2, 2, 12, 2),
    "fp16": StateBytes("fp16", 2, 2, 12, 2),
    "fp32": StateBytes("fp32", 4, 4, 8, 4),
}


@dataclass(frozen=True)
class ModelSize:
    """What the estimator needs to know about a decoder-only model."""

    total_params: int
    root_params: int  # everything outside the decoder layers: embeddings, final norm, head
    largest_layer_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    model_type: str
    architecture: str
    source: str


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (and per process on the host) for one stage; ``fits`` is None without a device size."""

    stage: int
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    total: float
    host: float
    device_memory: int | None
    fits: bool | None


def parse_stage(text: str | int) -> int:
    """0-3, or an FSDP/ZeRO name (NO_SHARD=0, SHARD_GRAD_OP=2, FULL_SHARD=3), as the sharded core accepts."""
    try:
        return normalise_stage(text)
    except ValueError as exc:
        raise EstimateError(str(exc)) from None


def parse_memory(text: str) -> int:
    """Bytes from '64GB' (10^9), '64GiB' (2^30), '80000MB', '512 MiB', or a plain byte count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*((?:[KMGT]I?)?B)?\s*", str(text), flags=re.IGNORECASE)
    if not match and str(text).strip().startswith("-"):
        raise EstimateError(f"device memory {text!r} is negative; give the device's size, at least 1 byte, e.g. 64GB")
    if not match:
        raise EstimateError(f"device memory {text!r} is not a size; write e.g. 64GB, 64GiB or 80000MB")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    scale = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    if int(number * scale) < 1:
        raise EstimateError(f"device memory {text!r} is no memory at all; write the device's size, e.g. 64GB")
    return int(number * scale)


def _need(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if key in config and (not isinstance(value, int) or isinstance(value, bool)):
        raise EstimateError(f"{where}: '{key}' is {value!r}, not a whole number; fix the config.json (a size is a "
                            "whole number of at least 1)")
    if not isinstance(value, int) or isinstance(value, bool):
        raise EstimateError(f"{where}: missing integer '{key}' (a Hugging Face decoder config.json has it)")
    if value < 1:
        raise EstimateError(f"{where}: '{key}' is {value}, an impossible size; fix the config.json (a size is at "
                            "least 1)")
    return value


def _positive(config: dict[str, Any], key: str, where: str) -> int | None:
    """An optional size (``head_dim``, ``num_key_value_heads``): None when absent, an error when impossible."""
    if config.get(key) is None:
        return None
    return _need(config, key, where)


def _shape(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelSize fields that describe the layer shapes (for activations), read from config.json values."""
    h, heads = _need(config, "hidden_size", where), _need(config, "num_attention_heads", where)
    model_type = config.get("model_type", "?")
    return {
        "num_layers": _need(config, "num_hidden_layers", where), "hidden_size": h, "num_heads": heads,
        "num_kv_heads": _positive(config, "num_key_value_heads", where) or heads,
        "head_dim": _positive(config, "head_dim", where) or max(1, h // heads),
        "intermediate_size": _need(config, "intermediate_size", where), "vocab_size": _need(config, "vocab_size", where),
        "model_type": model_type, "architecture": (config.get("architectures") or [model_type])[0],
    }


def model_size_from_config(config: dict[str, Any], where: str = "config.json") -> ModelSize:
    """Count the parameters of a LLaMA/Mistral/Qwen2/Qwen3-style decoder from its config.json values.

    embeddings V h; per layer: q (h x q_dim), k and v (h x kv_dim, GQA via num_key_value_heads),
    o (q_dim x h), biases as the family has them, gate/up/down (3 h i), two RMSNorms (2 h);
    final norm h; lm_head V h unless tie_word_embeddings.
    """
    model_type = config.get("model_type", "")
    if model_type not in DECODER_FAMILIES:
        raise EstimateError(f"{where}: model_type {model_type!r} is not a decoder this estimator can count from its "
                            f"config ({', '.join(DECODER_FAMILIES)}); pass the model folder with its .safetensors "
                            "files instead, their tensor shapes are counted directly")
    shape = _shape(config, where)
    h, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    qkv_bias, o_bias, qk_norm = DECODER_FAMILIES[model_type]
    if "attention_bias" in config and model_type != "qwen2":
        qkv_bias = o_bias = bool(config["attention_bias"])
    q_dim, kv_dim = shape["num_heads"] * head_dim, shape["num_kv_heads"] * head_dim
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h
    attention += (q_dim + 2 * kv_dim) * qkv_bias + h * o_bias + 2 * head_dim * qk_norm
    mlp = 3 * h * inter + (2 * inter + h) * bool(config.get("mlp_bias", False))
    layer = attention + mlp + 2 * h
    tied = bool(config.get("tie_word_embeddings", False))
    root = shape["vocab_size"] * h * (1 if tied else 2) + h
    return ModelSize(total_params=root + shape["num_layers"] * layer, root_params=root, largest_layer_params=layer,
                     source="config.json", **shape)


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a .safetensors file's header, without reading the tensor data."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > path.stat().st_size - 8:  # garbage read as a length: never allocate it
                raise ValueError(f"its header length {length} is larger than the file")
            header = json.loads(f.read(length))
        shapes = {name: [int(n) for n in info["shape"]] for name, info in header.items() if name != "__metadata__"}
    except (OSError, struct.error, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise EstimateError(f"{path}: not a readable .safetensors file ({exc})") from exc
    return shapes


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (ValueError, AttributeError, RecursionError) as exc:
            raise EstimateError(f"{index}: not a readable shard index ({exc}); remove it to count the *.safetensors "
                                "files, or pass the config.json alone") from exc
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EstimateError(f"{index} names shards that are not in the folder: {', '.join(missing[:3])}; "
                                "download them, or pass the config.json alone to count from the config")
        return files
    return sorted(folder.glob("*.safetensors"))


def count_safetensors(folder: Path) -> tuple[int, int, int] | None:
    """(total, root, largest layer) parameter counts from a folder's safetensors headers; None if it has none."""
    files = _safetensors_files(folder)
    if not files:
        return None
    per_layer: dict[int, int] = {}
    root = 0
    for file in files:
        for name, shape in safetensors_shapes(file).items():
            count = math.prod(shape)
            layer = _LAYER_KEY.search(name)
            if layer:
                per_layer[int(layer.group(1))] = per_layer.get(int(layer.group(1)), 0) + count
            else:
                root += count
    return root + sum(per_layer.values()), root, max(per_layer.values(), default=0)


def load_model_size(path: str | Path) -> ModelSize:
    """A ModelSize from a config.json file, or a model folder (its safetensors headers if present, else its config)."""
    path = Path(path)
    if not path.exists():
        raise EstimateError(f"--model {path}: no such file or folder (give a model folder or its config.json)")
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise EstimateError(f"--model {path}: the folder has no config.json (needed for the layer shapes)")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, RecursionError) as exc:
        raise EstimateError(f"{config_file}: not valid JSON ({exc}); give the model's config.json") from exc
    if not isinstance(config, dict):
        raise EstimateError(f"{config_file}: expected a JSON object of model settings")
    counted = count_safetensors(path) if path.is_dir() else None
    if counted is None:
        return model_size_from_config(config, str(config_file))
    total, root, largest = counted
    return ModelSize(total_params=total, root_params=root, largest_layer_params=largest,
                     source="safetensors headers", **_shape(config, str(config_file)))


def _plan(stage: int) -> ShardingPlan:
    return ShardingPlan.from_options(ShardingOptions(stage=stage))


def _grads_sharded(plan: ShardingPlan) -> bool:
    """Gradients live as shards: reduce-scattered as soon as each unit's are ready (stages 2-3)."""
    return plan.grad_reduction is GradReduction.REDUCE_SCATTER and plan.reduce_timing is ReduceTiming.AS_READY


def model_state_bytes(psi: float, nproc: int, stage: int, precision: StateBytes) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes per device: the ZeRO paper's formulas."""
    p, g, k = psi * precision.param_bytes, psi * precision.grad_bytes, psi * precision.optimizer_bytes
    plan = _plan(stage)
    return (p / nproc if plan.reshard_after_forward.frees else p, g / nproc if _grads_sharded(plan) else g,
            k / nproc if plan.shard_parameters else k)


def activation_bytes(size: ModelSize, micro_batch: int, seq_len: int, precision: StateBytes,
                     grad_ckpt: bool = False, attention: str = "sdpa") -> float:
    """Activations kept for the backward of one micro-batch (see the module docstring for the terms)."""
    if attention not in ("sdpa", "eager"):
        raise EstimateError(f"attention {attention!r} is not valid; use sdpa or eager")
    tokens, a = micro_batch * seq_len, precision.activation_bytes
    q_dim, kv_dim = size.num_heads * size.head_dim, size.num_kv_heads * size.head_dim
    layer = tokens * a * (4 * size.hidden_size + 2 * q_dim + 2 * kv_dim + 4 * size.intermediate_size)
    if attention == "eager":
        softmax_bytes = 4 if a == 4 else 4 + a  # fp32 softmax output, plus its compute-dtype copy
        layer += size.num_heads * seq_len * seq_len * micro_batch * softmax_bytes
    head = tokens * (2 * size.hidden_size * a + size.vocab_size * (a + 4 + (4 if a != 4 else 0)))
    if grad_ckpt:
        return size.num_layers * tokens * size.hidden_size * a + layer + head
    return size.num_layers * layer + head


def estimate_memory(size: ModelSize, nproc: int, stage: int, dtype: str = "bf16", offload: bool = False,
                    micro_batch: int = 1, seq_len: int = 2048, grad_ckpt: bool = False, attention: str = "sdpa",
                    device_memory: int | None = None) -> MemoryEstimate:
    """Per-device memory of one training configuration (see the module docstring for the model)."""
    if dtype not in PRECISIONS:
        raise EstimateError(f"dtype {dtype!r} is not valid; use {', '.join(PRECISIONS)}")
    for name, value in (("nproc", nproc), ("micro-batch", micro_batch), ("seq-len", seq_len)):
        if value < 1:
            raise EstimateError(f"--{name} must be at least 1, got {value}")
    for name, value, most, what in (("nproc", nproc, MAX_NPROC, "more devices than any job runs"),
                                    ("micro-batch", micro_batch, MAX_MICRO_BATCH, "more sequences than a device holds"),
                                    ("seq-len", seq_len, MAX_SEQ_LEN, "longer than any model's context")):
        if value > most:
            raise EstimateError(f"--{name} {value} is {what}; give at most {most:,}")
    try:
        plan = _plan(stage)
    except ValueError:
        raise EstimateError(f"stage {stage!r} is not valid; use 0, 1, 2 or 3") from None
    if offload and not plan.shard_parameters:
        raise EstimateError("--offload needs stage 1, 2 or 3 (at stage 0 every device keeps a full replica)")
    precision = PRECISIONS[dtype]
    params, grads, optimizer = model_state_bytes(size.total_params, nproc, stage, precision)
    host = 0.0
    if offload:  # optimizer states (with the fp32 master), gradient shards, parameter shards go to the host
        host, optimizer = host + optimizer, 0.0
        if _grads_sharded(plan):
            host, grads = host + grads, 0.0
        if plan.reshard_after_forward.frees:
            host, params = host + params, 0.0
    gathered = 0.0
    if _grads_sharded(plan):  # unsharded gradients of the root unit and of the layer being reduced
        gathered += precision.grad_bytes * (size.root_params + size.largest_layer_params)
    if plan.reshard_after_forward.frees:  # gathered parameters: the root unit and the in-flight layers
        gathered += precision.param_bytes * (size.root_params + MAX_INFLIGHT_ALL_GATHERS * size.largest_layer_params)
    activations = activation_bytes(size, micro_batch, seq_len, precision, grad_ckpt, attention)
    total = params + grads + optimizer + gathered + activations
    fits = None if device_memory is None else total <= USABLE_FRACTION * device_memory
    return MemoryEstimate(stage, params, grads, optimizer, gathered, activations, total, host, device_memory, fits)


def estimate_to_dict(size: ModelSize, estimates: list[MemoryEstimate], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON form printed by ``xshard estimate --json`` (all sizes in bytes)."""
    return {"model": asdict(size), "settings": settings, "usable_fraction": USABLE_FRACTION,
            "estimates": [{k: (round(v) if isinstance(v, float) else v) for k, v in asdict(e).items()}
                          for e in estimates]}
