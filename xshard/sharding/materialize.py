"""Build a model without its weights, then give each rank only its own rows.

A large model must not be built in full on every rank of a host (8 ranks x 15 GB of a 7B model).
The way round it has three steps:

1. ``meta_parameters()``: build the model with every *parameter* on the meta device (shapes and
   dtypes, no storage). Buffers stay real and are computed by the modules' own constructors, which
   is the one place that knows how: a rotary embedding's ``inv_freq`` is a non-persistent buffer
   that no checkpoint holds, so building it on the meta device too would leave nothing to load it
   from. Tied weights stay tied (the same meta Parameter is registered twice).
2. ``shard_model`` (stages 1-3) gives each meta parameter an empty dim-0 shard of this rank's rows
   (the core's meta-parameter hook in ``unit.py``), and never a full copy with values.
3. ``fill_shards(model, read_rows)`` asks ``read_rows`` for exactly this rank's rows of every
   parameter (e.g. a safetensors slice), and copies them into the shard.

Stage 0 replicates the whole model on every rank anyway, so there ``fill_parameters`` gives each
meta parameter its full value before ``shard_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from .layout import ShardedParamView, ShardLayout

#: ``read_rows(names, start, stop, shape, dtype)``: rows ``start:stop`` (dim 0) of the tensor stored
#: under the first of ``names`` that exists (a tied parameter has several names). ``shape`` and
#: ``dtype`` are the parameter's, for checking and for readers that must agree on a dtype (the
#: returned tensor may have another; it is cast on copy). A 0-dim tensor is asked for as rows 0:1.
RowReader = Callable[[list[str], int, int, torch.Size, torch.dtype], torch.Tensor]


class HoldsShards(Protocol):
    """What ``fill_shards`` needs of a model (a ``ShardedModel`` is one; model.py imports this module)."""

    def sharded_params(self) -> Sequence[ShardedParamView]:
        """Every parameter once, in unit order, with its names and layout."""
        ...

    def shards_changed(self) -> None:
        """The shards were written behind the version counters."""
        ...


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside the block, every parameter a module registers is moved to the meta device.

    Tensors created before registration (``nn.Linear``'s ``torch.empty``) are allocated but never
    written, so their pages are never touched, and initialisation after registration runs on meta.
    Not thread-safe (it patches ``nn.Module.register_parameter`` for the duration of the block).
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every qualified name it is registered under (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _read(read_rows: RowReader, names: list[str], rows: ShardLayout, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``rows`` describes, read and checked against the parameter's shape."""
    value = read_rows(names, rows.start, rows.stop, rows.shape, dtype)
    if value.numel() != rows.local_numel:
        raise ValueError(f"{names[0]}: the checkpoint gave rows of shape {tuple(value.shape)} for rows "
                         f"{rows.start}:{rows.stop} of a parameter of shape {tuple(rows.shape)}; the checkpoint "
                         "does not match the model's config")
    return value.reshape(rows.local_shape)


def fill_shards(model: HoldsShards, read_rows: RowReader) -> int:
    """Fill every shard of a ``ShardedModel`` (stages 1-3) with this rank's rows from ``read_rows``.

    Every rank must call it (a reader may run collectives), parameters in unit order. Returns the
    number of elements read. The model then gathers the new values before its next use.
    """
    read = 0
    with torch.no_grad():
        for view in model.sharded_params():
            value = _read(read_rows, list(view.names), view.layout, view.param.dtype)
            view.param.copy_(value.reshape(view.layout.local_shape))
            read += value.numel()
    model.shards_changed()
    return read


def fill_parameters(module: nn.Module, read_rows: RowReader, device: torch.device | str = "cpu") -> int:
    """Give every meta parameter of ``module`` its full value (stage 0, one process); ties are kept.

    Each parameter is replaced by a real Parameter in every place that registered it. Returns the
    number of elements read.
    """
    names = parameter_names(module)
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None and p.is_meta:
                places.setdefault(id(p), []).append((sub, attr))
                params[id(p)] = p
    read = 0
    with torch.no_grad():
        for key, p in params.items():
            value = _read(read_rows, names[key], ShardLayout.of(p.shape, 1, 0), p.dtype).reshape(p.shape)
            real = nn.Parameter(value.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad)
            for sub, attr in places[key]:
                sub._parameters[attr] = real
            read += value.numel()
    return read
