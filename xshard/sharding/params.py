"""One sharded parameter's two faces: the user's shard-holding Parameter and the full compute copy.

- the user's ``nn.Parameter``: its ``.data`` is this rank's dim-0 shard (a view of a padded buffer),
  in the model's dtype; the optimizer updates it and the reduced gradient shard lands in its
  ``.grad`` (same shape). ``requires_grad`` is read from it whenever a unit starts a forward, so
  freezing and unfreezing between steps take effect at the next forward.
- a full compute ``nn.Parameter`` (``param_dtype``, on the compute device) that is swapped into
  ``module._parameters`` while the unit runs forward or backward, and swapped back afterwards, so
  ``model.parameters()`` outside forward/backward always yields the user's Parameters.

When the plan frees full copies after forward, the storage is freed with
``untyped_storage().resize_(0)``: the tensor object autograd saved stays valid and is refilled
before backward needs it. Devices without resizable storage (XLA) replace ``.data`` instead.

With ``reshard_after_forward=k`` a third, transient face exists between a unit's forward and its
backward: ``post_forward``, this rank's piece of the full copy over a group of k ranks
(``post_layout``), from which backward gathers within that smaller group.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .layout import ShardLayout
from .wrap import ParamSpec


class Rebound:
    """Parameters that were replaced by new ones (they could not take their device data in place)."""

    def __init__(self) -> None:
        self.new: dict[int, nn.Parameter] = {}  # id(old) -> replacement
        self.old: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()

    def add(self, old: nn.Parameter, new: nn.Parameter) -> None:
        self.new[id(old)] = new
        self.old[id(old)] = old

    def __bool__(self) -> bool:
        return bool(self.new)


def rehome(spec: ParamSpec, data: torch.Tensor, rebound: Rebound) -> nn.Parameter:
    """Make the user's Parameter hold ``data`` (its shard, or itself on the compute device).

    ``param.data = data`` keeps the Parameter object, so optimizers built earlier stay valid. A
    tensor type that cannot take another's data in place (a CPU Parameter and an XLA tensor, or a meta
    Parameter) gets a new Parameter in every place that registered the old one; ``rebound`` records
    it, so that the caller can rebind optimizers that hold the old one (as Accelerate does on TPUs).
    """
    p = spec.param
    if p.is_meta or not torch._has_compatible_shallow_copy_type(p, data):
        new = nn.Parameter(data, requires_grad=p.requires_grad)
        for module, attr in spec.places:
            module._parameters[attr] = new
        rebound.add(p, new)  # a meta Parameter too (sharded_init): an optimizer built on it is rebound
        spec.param = new
        return new
    p.data = data
    return p


class ShardedParam:
    """One parameter of a unit: the user's shard-holding Parameter and the full compute copy."""

    def __init__(self, spec: ParamSpec, world_size: int, rank: int, device: torch.device,
                 shard_device: torch.device, gather_dtype: torch.dtype, resident: bool,
                 frees_storage_by_resize: bool, rebound: Rebound, post_forward_size: int | None = None) -> None:
        p = spec.param
        self.spec = spec
        self.layout = ShardLayout.of(p.shape, world_size, rank)
        #: the geometry of the post-forward piece (reshard_after_forward=k; groups of k consecutive
        #: ranks inside the shard group), and the piece itself while it is held
        self.post_layout = (ShardLayout.of(p.shape, post_forward_size, rank % post_forward_size)
                            if post_forward_size else None)
        self.post_forward: torch.Tensor | None = None
        self.dtype = p.dtype
        self.gather_dtype = gather_dtype
        lay = self.layout
        with torch.no_grad():
            self.padded = torch.zeros(lay.seg, dtype=p.dtype, device=shard_device)
            # A parameter on the meta device has no values yet: its shard is allocated (zeros) and
            # filled afterwards by xshard.sharding.materialize.
            if not p.is_meta:
                self.padded[: lay.local_numel].copy_(lay.local_rows(p.detach()).reshape(-1))
            #: the full parameter is the first ``numel`` elements of ``gather_numel`` (>= numel when
            #: dim 0 does not divide by the world size), so padded shards line up with no copy out
            flat = torch.empty(self.storage_numel, dtype=gather_dtype, device=device)
            full = flat[: lay.numel].view(lay.shape)
            if resident and not p.is_meta:  # resident copies start from local values (gathered before use)
                full.copy_(p.detach())
            self.full = nn.Parameter(full, requires_grad=p.requires_grad)
            self.user: nn.Parameter = rehome(spec, self.padded[: lay.local_numel].view(lay.local_shape), rebound)
        self.full_bytes = self.storage_numel * self.full.element_size()
        # Where all-gathers write: the full parameter's own storage seen flat, padding included. A
        # separate tensor object (own version counter), so refilling a storage that autograd saved
        # in forward does not look like an in-place change of the saved tensor. Devices that free
        # by replacing ``.data`` get a fresh target per gather instead.
        self.gather_target: torch.Tensor | None = None
        #: the full copy's storage where it is freed by resizing (the same object for the copy's life:
        #: freeing and refilling resize it, or move its memory, in place)
        self.storage: torch.UntypedStorage | None = None
        if frees_storage_by_resize:
            self.storage = self.full.untyped_storage()
            # torch's stubs demand a stride beside the size; the default (contiguous) is what is meant here
            self.gather_target = torch.empty(0, dtype=gather_dtype, device=device).set_(  # type: ignore[call-overload]
                self.full.untyped_storage(), 0, (self.storage_numel,))

    @property
    def storage_numel(self) -> int:
        """Elements of the full copy's storage: room for an all-gather over either group."""
        post = self.post_layout.gather_numel if self.post_layout is not None else 0
        return max(self.layout.gather_numel, post)

    @property
    def trainable(self) -> bool:
        """Does the user's Parameter want a gradient (read now: freezing takes effect at once)?"""
        return self.user.requires_grad

    def sync_requires_grad(self) -> bool:
        """Give the compute copy the user's ``requires_grad``; True if it changed."""
        want = self.user.requires_grad
        if self.full.requires_grad == want:
            return False
        self.full.requires_grad_(want)
        if not want:
            self.full.grad = None
        return True

    def version(self) -> int:
        """The shard's version counter: it moves whenever the shard is written in place."""
        return self.user._version
