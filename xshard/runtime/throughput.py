"""Throughput in every run: tokens and samples per second, TFLOPs per device and MFU.

What is counted, and how it costs no synchronisation the step did not already have:

- tokens and samples: a forward pre-hook on each prepared model reads the training batch it is called with:
  its token ids are ``input_ids``, else the first positional tensor when it holds integers. Samples are the
  first dimension of the ids (of the batch's first tensor where it has no ids: images, audio features,
  ``inputs_embeds``), tokens the ids' element count, and the non-padding tokens the sum of its
  ``attention_mask`` where there is one. The mask's sum
  stays a device tensor, added up on the device, and is read only when a report is asked for (a loop
  that logs has already synchronised for its loss). Forwards without gradients (evaluation,
  generation) are not counted.
- time: the wall clock between optimizer steps (``JobState.finish_optimizer_step``). The first step of a
  run is left out of the rate (compilation, warm-up, allocator growth).
- model FLOPs per token: for a model with a transformers-style config (``num_hidden_layers``,
  ``hidden_size``) the decoder formula of the PaLM paper (appendix B), as torchtitan counts it:
  ``6 * N + 12 * L * d * s`` for N parameters without the input embedding, L layers, width d and
  sequence length s (forward and backward; no activation recomputation: this is MFU, not HFU); a
  multimodal model's text config gives L and d where its own config has none; for any other model
  ``6 * N`` (attention-free). ``flops_formula`` in the report says which.
- no estimate: a model whose training batches carry no token ids (a vision or audio model, a model fed
  ``inputs_embeds``) has no FLOPs per token. Its report has no TFLOPs or MFU (None), ``flops_formula`` None
  and ``no_flops_reason`` saying why, and the main process logs that reason once at INFO. Counting never
  stops a run: a model or batch it cannot read (no ``get_input_embeddings``, no config, a batch of
  another shape) leaves the estimate out with the reason, never an exception.
- peak: the device's dense bf16/fp16 (or fp32) figure from its backend's table (``Backend.peak_tflops``),
  looked up by the name the backend reports (``Backend.device_name``), each figure with its source;
  ``XSHARD_PEAK_TFLOPS`` overrides it; on a CPU it is measured once by a matmul probe in the compute dtype
  (``Backend.measured_peak_tflops``). A device with no figure reports no MFU (None) and says why.

Each rank measures its own numbers; ``Accelerator.throughput()`` returns this rank's (rank 0's is what
the main process logs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..backends import PeakTable, peak_tflops_table
from ..errors import XShardError
from .rank_logging import get_logger

_log = get_logger("xshard.throughput")

#: the environment variable that sets the peak TFLOPS per device, whatever the device
PEAK_ENV = "XSHARD_PEAK_TFLOPS"


@dataclass(frozen=True)
class PeakFlops:
    """The peak a device is measured against: TFLOPS (None when unknown) and where the figure comes from."""

    tflops: float | None
    source: str


def dtype_name(dtype: torch.dtype | None) -> str:
    """"bf16", "fp16" or "fp32" (the compute dtype; None is fp32)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32") if dtype is not None else "fp32"


def peak_flops(device_name: str, dtype: torch.dtype | None, *, table: PeakTable | None = None,
               measure: Callable[[], float | None] | None = None, env: dict[str, str] | None = None) -> PeakFlops:
    """The peak of one device in ``dtype``: ``XSHARD_PEAK_TFLOPS``, else ``table`` (the backend's
    ``peak_tflops``; None: every backend's, ``peak_tflops_table()``), else ``measure()``
    (``Backend.measured_peak_tflops``: a CPU's probe; None where the backend measures nothing), else
    unknown with the reason."""
    environ = os.environ if env is None else env
    override = environ.get(PEAK_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise XShardError(f"{PEAK_ENV}={override!r} is not a positive number of TFLOPS per device: "
                              f"e.g. {PEAK_ENV}=312 for an A100 in bf16")
        return PeakFlops(value, f"{PEAK_ENV}")
    table = peak_tflops_table() if table is None else table
    model = table.model_of(device_name)
    wanted = dtype_name(dtype)
    if model is not None and wanted in table.figures[model]:
        tflops, source = table.figures[model][wanted]
        return PeakFlops(tflops, f"{model} {wanted}: {source}")
    measured = measure() if measure is not None else None
    if measured is not None:
        return PeakFlops(measured, f"measured: a {wanted} matmul on this device")
    return PeakFlops(None, f"no {wanted} peak known for {device_name!r}: set {PEAK_ENV}")


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _layers_and_width(config: Any) -> tuple[int | None, int | None]:
    """L and d of a transformers-style config; a multimodal one's text config where its own has neither."""
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    width = _config_value(config, "hidden_size", "n_embd", "d_model")
    get_text_config = getattr(config, "get_text_config", None)
    if (layers is None or width is None) and callable(get_text_config):
        text = get_text_config()
        if text is not None and text is not config:
            return _layers_and_width(text)
    return layers, width


def _input_embedding_numel(module: torch.nn.Module, full_numel: Callable[[torch.Tensor], int]) -> int:
    """The whole size of the model's input embedding, 0 where it has none it can name.

    transformers' ``get_input_embeddings`` raises NotImplementedError on a model without one (ResNet, CLIP's
    two-tower model): then nothing is taken off N."""
    get_embeddings = getattr(module, "get_input_embeddings", None)
    if not callable(get_embeddings):
        return 0
    try:
        embeddings = get_embeddings()
    except Exception:  # any model's own method: the count goes on without it
        return 0
    return full_numel(embeddings.weight) if isinstance(embeddings, torch.nn.Embedding) else 0


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of one trained token of a model, by the formula ``formula`` names (``of`` never raises)."""

    params: int
    embedding_params: int
    layers: int | None
    width: int | None
    #: why the model has no FLOPs estimate (its parameters could not be counted), or None
    no_flops_reason: str | None = None
    #: the model's class name (the log line names it)
    name: str = "the model"

    @property
    def formula(self) -> str | None:
        """The formula the FLOPs follow, None where there is no estimate."""
        if self.no_flops_reason is not None:
            return None
        return "6N + 12*L*d*s (PaLM, decoder)" if self.layers and self.width else "6N (no attention term)"

    def per_token(self, seq_len: int) -> float:
        """Model FLOPs (forward and backward) of one token of a sequence of ``seq_len``."""
        n = self.params - self.embedding_params
        attention = 12 * self.layers * self.width * seq_len if self.layers and self.width else 0
        return 6.0 * n + attention

    @classmethod
    def of(cls, module: torch.nn.Module, full_numel: Callable[[torch.Tensor], int]) -> ModelFlops:
        """Count ``module``'s parameters (whole sizes: ``full_numel`` of a shard) and read its config.

        Any model gets an answer: one that cannot be read has no estimate and says why."""
        name = type(getattr(module, "_orig_mod", module)).__name__  # a torch.compile'd model: its own class
        try:
            seen: set[int] = set()
            params = 0
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params += full_numel(p)
        except Exception as exc:  # a metric never stops a run
            return cls(0, 0, None, None, f"{name}'s parameters could not be counted ({type(exc).__name__}: {exc})",
                       name)
        try:
            embedding = _input_embedding_numel(module, full_numel)
            layers, width = _layers_and_width(getattr(module, "config", None))
        except Exception:  # an unreadable config: the attention-free formula
            embedding, layers, width = 0, None, None
        return cls(params, embedding, layers, width, None, name)


def _token_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The batch's token ids: ``input_ids``, else the first positional tensor when it holds integers."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and not first.is_floating_point() and not first.is_complex() and first.dim() > 0:
        return first
    return None


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)


class ThroughputMeter:
    """Counts one rank's trained tokens and samples per optimizer step (see the module docstring)."""

    def __init__(self) -> None:
        #: the FLOPs counts of the prepared models, in preparation order
        self.models: list[ModelFlops] = []
        #: why the run has no FLOPs estimate (the first reason found; it holds for the rest of the run), or None
        self.no_flops_reason: str | None = None
        self._since: float | None = None  # the end of the window's first step
        self._clear()

    def _clear(self) -> None:
        self._steps = 0
        self._tokens = 0
        self._samples = 0
        self._unmasked_tokens = 0  # tokens of the batches without a mask (counted by shape)
        self._flops = 0.0  # their model FLOPs
        #: the masks' sums, on the device, by the model FLOPs of one token of their sequence length (integer
        #: sums: every device has them, where float64 is not on every one)
        self._real_tokens: dict[float, torch.Tensor] = {}

    def count_batch(self, model: ModelFlops, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Count the batch a training forward of ``model`` is called with (a forward pre-hook's arguments)."""
        if self._since is None:
            return  # before the first step ends: warm-up, not in the rate
        if model.no_flops_reason is not None:
            self.no_flops(model.no_flops_reason)
        ids = _token_ids(args, kwargs)
        if ids is None:
            first = _first_tensor(args, kwargs)
            if first is not None:
                self._samples += int(first.shape[0])
            names = ", ".join(k for k, v in kwargs.items() if isinstance(v, torch.Tensor)) or "positional tensors"
            self.no_flops(f"{model.name}'s training batches carry no token ids (input_ids or an integer tensor; they have "
                          f"{names}): FLOPs per token do not apply")
            return
        self._samples += int(ids.shape[0])
        self._tokens += int(ids.numel())
        per_token = model.per_token(int(ids.shape[-1]) if ids.dim() > 1 else 1)
        mask = kwargs.get("attention_mask")
        if not (isinstance(mask, torch.Tensor) and mask.shape == ids.shape):
            self._unmasked_tokens += int(ids.numel())
            self._flops += per_token * ids.numel()
            return
        real = mask.sum()  # stays on the device until a report reads it
        held = self._real_tokens.get(per_token)
        self._real_tokens[per_token] = real if held is None else held + real

    def no_flops(self, reason: str) -> None:
        """The run has no FLOPs estimate, for ``reason``: its reports say so, and the main process logs it once."""
        if self.no_flops_reason is None:
            self.no_flops_reason = reason
            _log.info(f"throughput: no TFLOPs or MFU for this run: {reason}", main_process_only=True)

    def step_finished(self) -> None:
        """An optimizer step ended (the first one opens the window)."""
        if self._since is None:
            self._since = time.perf_counter()
        else:
            self._steps += 1

    def report(self, world_size: int, peak: PeakFlops) -> dict[str, Any]:
        """This rank's rates since the last report (or the first step), then a new window.

        Reads the counted attention-mask sums: one device-to-host copy, here only."""
        now = time.perf_counter()
        elapsed = now - self._since if self._since is not None else 0.0
        real_tokens, flops = None, self._flops
        if self._real_tokens:  # one copy to the host, whatever the number of sequence lengths seen
            sums = torch.stack([t.reshape(()).long() for t in self._real_tokens.values()]).cpu().tolist()
            real_tokens = sum(sums)
            flops += sum(per_token * n for per_token, n in zip(self._real_tokens, sums, strict=True))
        counted = self._unmasked_tokens + (real_tokens or 0)
        estimated = self.no_flops_reason is None
        out: dict[str, Any] = {"steps": self._steps, "seconds": elapsed, "tokens": self._tokens,
                               "non_padding_tokens": counted, "samples": self._samples,
                               "flops_formula": self.models[0].formula if self.models and estimated else None,
                               "no_flops_reason": self.no_flops_reason,
                               "peak_tflops": peak.tflops, "peak_source": peak.source,
                               "tokens_per_second_per_device": None, "samples_per_second": None,
                               "tflops_per_device": None, "mfu": None}
        if elapsed > 0 and self._steps > 0:
            out["samples_per_second"] = self._samples * world_size / elapsed
            if self._tokens:
                out["tokens_per_second_per_device"] = counted / elapsed
            if estimated:
                out["tflops_per_device"] = flops / elapsed / 1e12
                out["mfu"] = out["tflops_per_device"] / peak.tflops if peak.tflops else None
        self._clear()
        if self._since is not None:
            self._since = now
        return out


def counting_hook(meter: ThroughputMeter, model: ModelFlops) -> Callable[..., None]:
    """A forward pre-hook (``with_kwargs=True``) that counts the training batches of ``model``; a batch it
    cannot read leaves the run without a FLOPs estimate, never stops the forward."""

    def count(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training and torch.is_grad_enabled():
            try:
                meter.count_batch(model, args, kwargs)
            except Exception as exc:  # a metric never stops a run
                meter.no_flops(f"a training batch of {model.name} could not be counted ({type(exc).__name__}: {exc})")

    return count


#: the rates a log line carries (the report's other entries are counts and provenance)
LOGGED_RATES = ("tokens_per_second_per_device", "tflops_per_device", "mfu")


def throughput_values(report: dict[str, Any], prefix: str) -> dict[str, float]:
    """The report's measured rates as a log line's values, named ``prefix + rate`` (none before a step is timed)."""
    return {prefix + name: float(report[name]) for name in LOGGED_RATES if report.get(name) is not None}
