"""Auto-wrap policies: split a model into units, each parameter in exactly one unit.

A unit is a module whose parameters are gathered and reduced together (one all-gather and one
reduce-scatter per step). The root unit is the model itself and holds every parameter that no
other unit holds (embeddings, final norm, head). A parameter registered in modules of different
units (tied embedding and LM head) goes to the root unit, so it is gathered once and its two
gradient contributions are summed by autograd before the unit reduces it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from .options import ShardingOptions

log = logging.getLogger("xshard.sharding")


@dataclass
class ParamSpec:
    """One parameter and every (module, attribute) that registers it."""

    fqn: str
    param: nn.Parameter
    places: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass
class UnitSpec:
    """A unit's module, qualified name ("" for the root) and parameters."""

    module: nn.Module
    name: str
    params: list[ParamSpec]


def _class_names(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def _transformer_units(model: nn.Module, names: list[str]) -> set[nn.Module]:
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(
            f"transformer_layer_cls_to_wrap names {missing}, but no module of the model has that class; "
            f"the model's classes are {_class_names(model)}"
        )
    wanted = set(names)
    chosen: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in wanted:
                chosen.add(child)  # outermost match: layers nested in a layer stay in it
            else:
                visit(child)

    visit(model)
    return chosen


def _size_units(model: nn.Module, min_num_params: int) -> set[nn.Module]:
    chosen: set[nn.Module] = set()
    seen: set[int] = set()

    def visit(module: nn.Module, is_root: bool) -> int:
        total = 0
        for child in module.children():
            total += visit(child, False)
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        if not is_root and total >= min_num_params:
            chosen.add(module)
            return 0
        return total

    visit(model, True)
    return chosen


def _declared_blocks(model: nn.Module) -> list[str]:
    """The block classes of the model's ``_no_split_modules`` that it has: a composite model (LLaVA) lists its
    towers' blocks, some of which it never builds (CLIP's text embeddings beside a vision tower)."""
    present = {type(m).__name__ for m in model.modules()}
    return sorted(n for n in getattr(model, "_no_split_modules", None) or [] if n in present)


def split_into_units(model: nn.Module, options: ShardingOptions) -> list[UnitSpec]:
    """The model's units by ``options.auto_wrap_policy``; the root unit first, then forward-definition order."""
    names = options.transformer_layer_cls_to_wrap or _declared_blocks(model)
    if options.auto_wrap_policy == "transformer" and not names:
        # the default policy on a model that names no block class (any plain PyTorch or torchvision
        # model): size-based units, as a user of FSDP's size_based_auto_wrap_policy would choose
        log.info("%s names no block class (_no_split_modules) and transformer_layer_cls_to_wrap is unset: units "
                 "by size instead (auto_wrap_policy='size', min_num_params=%d; the model's classes are %s)",
                 type(model).__name__, int(options.min_num_params), _class_names(model))
        unit_modules = _size_units(model, int(options.min_num_params))
    elif options.auto_wrap_policy == "transformer":
        unit_modules = _transformer_units(model, names)
    elif options.auto_wrap_policy == "size":
        unit_modules = _size_units(model, int(options.min_num_params))
    else:
        unit_modules = set()

    owner_of: dict[nn.Module, nn.Module] = {}  # module -> innermost unit module containing it

    def assign(module: nn.Module, unit: nn.Module) -> None:
        owner_of[module] = unit
        for child in module.children():
            assign(child, child if child in unit_modules else unit)

    assign(model, model)

    specs: dict[int, ParamSpec] = {}
    unit_of: dict[int, nn.Module] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            key = id(p)
            if key not in specs:
                specs[key] = ParamSpec(f"{mod_name}.{attr}" if mod_name else attr, p)
                unit_of[key] = owner_of[module]
            elif unit_of[key] is not owner_of[module]:
                unit_of[key] = model  # used by modules of different units: the root unit holds it
            if (module, attr) not in [(m, a) for m, a in specs[key].places]:
                specs[key].places.append((module, attr))

    order = [model] + [m for _, m in model.named_modules() if m in unit_modules]
    name_of = {m: n for n, m in model.named_modules()}
    units = []
    for module in order:
        params = [s for k, s in specs.items() if unit_of[k] is module]
        if params or module is model:
            units.append(UnitSpec(module, name_of[module], params))
    return units


def is_norm(module: nn.Module) -> bool:
    """Normalisation layers (kept in fp32 with keep_norms_fp32): torch's and any class named *Norm."""
    norm_types: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.LocalResponseNorm)
    rms = getattr(nn, "RMSNorm", None)
    if rms is not None:
        norm_types = (*norm_types, rms)
    return isinstance(module, norm_types) or type(module).__name__.lower().endswith("norm")


def param_owner_is_norm(spec: ParamSpec) -> bool:
    """Is every module that registers this parameter a norm layer?"""
    return all(is_norm(m) for m, _ in spec.places)
