"""Sharded init: build a model in code without ever holding it whole, with the values a normal init gives.

    torch.manual_seed(0)
    with xshard.sharding.sharded_init():      # or: with accelerator.sharded_init():
        model = MyModel()                      # parameters on the meta device: no memory
    model = shard_model(model, backend, options)   # or accelerator.prepare(model)

The parameters equal those of ``torch.manual_seed(0); MyModel()`` bit for bit, and each rank only ever
holds one parameter whole (plus its shards), where a normal init holds the whole model on every rank
(and the host keeps those pages after they are freed). It plays the role of DeepSpeed's
``zero.Init`` and of FSDP2's meta-device flow (``torch.device("meta")`` + ``to_empty`` +
``reset_parameters``), with one difference from both: no module has to define
``reset_parameters`` and no value depends on the order in which shards are filled.

How (design note): inside the block, every parameter a module registers moves to the meta device (as
``materialize.meta_parameters`` does; buffers stay real and are computed by their constructors), and a
``TorchDispatchMode`` records every operation that touches a meta tensor: ``kaiming_uniform_``,
``normal_``, ``fill_`` on a row (an Embedding's padding row), a parent module re-initialising its
children, weight tying, ``orthogonal_``'s QR of a temporary... each as (op, arguments) with the
tensors as references (a parameter or an earlier op's output, plus a view's geometry). A random op
also stores the generator's state before it, and runs once on a scratch tensor of the same
geometry, so the generator advances exactly as in a normal init: the code after the block (data
order, dropout) draws the same numbers as without sharded init. When the model is sharded, each
parameter is rebuilt alone: the ops it depends on (those that wrote it, and transitively what they
read) are replayed in their recorded order into real tensors, each random op from its stored
generator state, and only this rank's rows are kept (``materialize.fill_shards``).

What it cannot replay, it refuses with the reason: reading a parameter's value during construction
(``.item()``, a Python ``if`` on a tensor), and parameters changed after the block (e.g.
``model.to(torch.bfloat16)``: build in the dtype you want, or cast after ``prepare``). Tensors passed
to ``nn.Parameter(...)`` with values (``torch.ones``) are kept until sharding unless an init op
overwrites them entirely first (as torch's layers do with their ``torch.empty``).

With ``sync_module_states`` (multi-process jobs under the Accelerator) rank 0 rebuilds each parameter and
broadcasts it, one at a time, so every rank keeps rank 0's rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# ops that give every element of their (mutated) first argument a new value independent of the old
_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "copy_", "bernoulli_", "random_", "exponential_",
               "geometric_", "log_normal_", "cauchy_"}


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class _Ref:
    """A meta tensor in a recorded op: an op's output (``index``, ``pos``), or a view of a storage
    (``owner``: a parameter's or an output's storage key) with its geometry."""

    index: int = -1
    pos: int = -1
    owner: int = 0
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0


@dataclass
class _Op:
    func: Any
    args: Any  # (args, kwargs) with meta tensors replaced by _Ref
    deps: set[int]
    rng: tuple[torch.Generator | None, torch.Tensor] | None  # (generator, its state before the op)


@dataclass
class _Storage:
    """A meta storage the recording knows: a parameter's or an op output's, and the ops that wrote it."""

    base: torch.Tensor  # the meta tensor that owns it (kept alive: storage keys are addresses)
    produced_by: tuple[int, int] | None  # (op, output position); None for a parameter
    initial: torch.Tensor | None = None  # a parameter's value before any op (None: not needed)
    writes: list[int] = field(default_factory=list)


class InitRecording:
    """What happened to the meta tensors of one ``sharded_init`` block, and how to rebuild any of them."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.storages: dict[int, _Storage] = {}
        self.produced: dict[int, tuple[int, int]] = {}  # id(output tensor) -> (op, position)
        self._alive: list[torch.Tensor] = []  # outputs referenced by ``produced`` (ids must stay unique)

    # ------------------------------------------------------------------ recording
    def add_parameter(self, meta: torch.Tensor, initial: torch.Tensor) -> None:
        """A parameter moved to the meta device; ``initial`` is the value it was created with."""
        # keep an alias, not the Parameter: ``model.to(...)`` after the block swaps the Parameter's
        # ``.data``, which would free the recorded storage and let a new one reuse its address (its
        # key), so that another parameter's recording answered for it
        with torch.utils._python_dispatch._disable_current_modes():
            alias = meta.detach()
        self.storages[_storage_key(meta)] = _Storage(alias, None, initial.detach())

    def ref(self, t: torch.Tensor) -> _Ref:
        """The reference to meta tensor ``t`` (raises for a meta tensor made outside the block)."""
        exact = self.produced.get(id(t))
        if exact is not None:
            return _Ref(index=exact[0], pos=exact[1])
        key = _storage_key(t)
        if key not in self.storages:
            raise RuntimeError("sharded_init: an operation used a meta tensor created outside the sharded_init "
                               "block; create every tensor of the model inside it (or outside, on a real device)")
        return _Ref(owner=key, size=tuple(t.shape), stride=tuple(t.stride()), offset=int(t.storage_offset()))

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run aten op ``func`` on the meta tensors, advance the generator as the real op would, record it."""
        rng = None
        if _is_random(func):
            rng = _rng_state(kwargs)
            _run_on_scratch(func, args, kwargs)
        out = func(*args, **kwargs)
        self._add(func, args, kwargs, out, rng, _written(func, args, kwargs))
        return out

    def record_call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Record a whole init function on a meta tensor (its first argument, which it fills): for
        ``torch.nn.init`` functions that skip meta tensors or loop on the values they draw
        (``trunc_normal_``'s rejection sampling, ``orthogonal_``'s QR). It runs on a scratch tensor now,
        to advance the generator, and is called again on the real tensor when the parameter is rebuilt."""
        rng = _rng_state(kwargs)
        _run_on_scratch(func, args, kwargs)
        target = args[0]
        self._add(func, args, kwargs, target, rng, [target], overwrites=True)
        return target

    def _add(self, func: Any, args: tuple, kwargs: dict, out: Any, rng: Any, written: list[torch.Tensor],
             overwrites: bool = False) -> None:
        index = len(self.ops)
        deps: set[int] = set()

        def to_ref(x: Any) -> Any:
            if not (isinstance(x, torch.Tensor) and x.is_meta):
                return x
            ref = self.ref(x)
            if ref.index >= 0:
                deps.add(ref.index)
            owner = self.storages.get(_storage_key(x))
            if owner is not None:
                deps.update(w for w in owner.writes if w < index)
                if owner.produced_by is not None:
                    deps.add(owner.produced_by[0])
            return ref

        refs = pytree.tree_map(to_ref, (args, kwargs))
        for t in written:
            owner = self.storages.get(_storage_key(t))
            if owner is not None:
                if (owner.initial is not None and not owner.writes and owner.produced_by is None
                        and _overwrites_whole(func, t, owner.base, overwrites)):
                    owner.initial = None  # its first op replaces every value: the creation value is not needed
                owner.writes.append(index)
        for pos, o in enumerate(pytree.tree_leaves(out)):
            if isinstance(o, torch.Tensor) and o.is_meta and id(o) not in self.produced:
                if not any(o is a for a in pytree.tree_leaves((args, kwargs))):
                    self.produced[id(o)] = (index, pos)
                    self._alive.append(o)
                key = _storage_key(o)
                if key not in self.storages:
                    self.storages[key] = _Storage(o, (index, pos))
        self.ops.append(_Op(func, refs, deps, rng))

    # ------------------------------------------------------------------ replay
    def materialize(self, meta: torch.Tensor) -> torch.Tensor:
        """The real value of meta tensor ``meta`` (a parameter of the recorded model), rebuilt on the CPU."""
        target = self.ref(meta)
        owner = self.storages.get(target.owner) if target.index < 0 else None
        needed: set[int] = set()
        stack = [target.index] if owner is None else list(owner.writes)  # ref() found every owner
        if owner is not None and owner.produced_by is not None:
            stack.append(owner.produced_by[0])
        while stack:
            i = stack.pop()
            if i not in needed:
                needed.add(i)
                stack.extend(self.ops[i].deps)
        reals: dict[Any, torch.Tensor] = {}
        cpu_state = torch.get_rng_state()
        try:
            with torch.no_grad():
                for i in sorted(needed):
                    self._replay(i, reals)
                return self._resolve(target, reals).clone()
        finally:
            torch.set_rng_state(cpu_state)

    def _replay(self, i: int, reals: dict[Any, torch.Tensor]) -> None:
        op = self.ops[i]
        args, kwargs = pytree.tree_map(lambda x: self._resolve(x, reals) if isinstance(x, _Ref) else x, op.args)
        if op.rng is not None:
            generator, state = op.rng
            if generator is None:
                torch.set_rng_state(state)
            else:
                kept = generator.get_state()
                generator.set_state(state)
        out = op.func(*args, **kwargs)
        if op.rng is not None and op.rng[0] is not None:
            op.rng[0].set_state(kept)
        for pos, o in enumerate(pytree.tree_leaves(out)):
            if isinstance(o, torch.Tensor):
                reals[(i, pos)] = o

    def _resolve(self, ref: _Ref, reals: dict[Any, torch.Tensor]) -> torch.Tensor:
        if ref.index >= 0:
            return reals[(ref.index, ref.pos)]
        owner = self.storages[ref.owner]
        base: torch.Tensor | None
        if owner.produced_by is not None:
            base = reals[owner.produced_by]
        else:
            base = reals.get(("param", ref.owner))
            if base is None:
                meta = owner.base
                base = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
                if owner.initial is not None:
                    base.copy_(owner.initial)
                reals[("param", ref.owner)] = base
        if ref.size == tuple(base.shape) and ref.stride == tuple(base.stride()) and ref.offset == base.storage_offset():
            return base
        return base.as_strided(ref.size, ref.stride, ref.offset)


def _is_random(func: Any) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments)


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The meta tensors ``func`` writes into (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_meta]
    return out


def _rng_state(kwargs: dict) -> tuple[torch.Generator | None, torch.Tensor]:
    """(the op's generator or None for the default CPU one, its state now)."""
    generator = kwargs.get("generator")
    return generator, (generator.get_state() if generator is not None else torch.get_rng_state())


def _overwrites_whole(func: Any, t: torch.Tensor, base: torch.Tensor, overwrites: bool) -> bool:
    if not overwrites:
        schema = getattr(func, "_schema", None)
        overwrites = schema is not None and schema.name.split("::")[-1] in _OVERWRITES
    return (overwrites and tuple(t.shape) == tuple(base.shape) and t.stride() == base.stride()
            and t.storage_offset() == base.storage_offset())


def _run_on_scratch(func: Any, args: tuple, kwargs: dict) -> None:
    """Run a random op on zero-filled CPU tensors shaped like its meta arguments (same storage size,
    strides and offset: the same kernel path), so the generator advances as the real op would."""

    def scratch(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_meta):
            return x
        numel = x.untyped_storage().nbytes() // max(1, x.element_size())
        return torch.zeros(numel, dtype=x.dtype).as_strided(x.shape, x.stride(), x.storage_offset())

    s_args, s_kwargs = pytree.tree_map(scratch, (args, kwargs))
    if "device" in s_kwargs:
        s_kwargs["device"] = torch.device("cpu")
    with torch.no_grad():
        func(*s_args, **s_kwargs)


class _Recorder(TorchDispatchMode):
    """Sends every operation on a meta tensor to the recording."""

    def __init__(self, recording: InitRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if not any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(
                "sharded_init: the model's construction reads a parameter's value (.item(), bool(tensor), "
                "tolist(), ...), which does not exist yet inside sharded_init. Build this model outside "
                "sharded_init, or move the read after prepare()/shard_model()")
        return self.recording.record(func, args, kwargs)


#: ``torch.nn.init`` functions recorded as whole calls (see ``InitRecording.record_call``): the ones
#: that return early for meta tensors or branch on the values they draw. The private helper stands
#: for ``trunc_normal_``, so a copy of the public function imported before the block is caught too.
_RECORDED_CALLS = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@contextlib.contextmanager
def _recorded_calls(recording: InitRecording) -> Iterator[None]:
    originals = {name: getattr(torch.nn.init, name) for name in _RECORDED_CALLS if hasattr(torch.nn.init, name)}

    def wrap(original: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return recording.record_call(original, (tensor, *args), kwargs)
            return original(tensor, *args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(torch.nn.init, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.nn.init, name, original)


#: attribute naming, on each meta parameter made inside a sharded_init block, its recording
_RECORDING_ATTR = "_xshard_init_recording"


@contextlib.contextmanager
def sharded_init() -> Iterator[InitRecording]:
    """Build models inside this block with their parameters on the meta device; ``shard_model`` (or
    ``Accelerator.prepare``) then gives every rank its rows of the values a normal init gives.

    See the module docstring. Not thread-safe (it patches ``nn.Module.register_parameter`` and
    installs a dispatch mode for the duration of the block). Yields the ``InitRecording``.
    """
    recording = InitRecording()
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            initial = param.detach()
            with torch.utils._python_dispatch._disable_current_modes():
                meta = type(param)(initial.to("meta"), requires_grad=param.requires_grad)
            recording.add_parameter(meta, initial)
            setattr(meta, _RECORDING_ATTR, recording)
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        with _recorded_calls(recording), _Recorder(recording):
            yield recording
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def recording_of(module: nn.Module) -> InitRecording | None:
    """The recording a module's meta parameters were made in (None: not built under ``sharded_init``)."""
    for p in module.parameters():
        recording = p.__dict__.get(_RECORDING_ATTR) if p.is_meta else None
        if recording is not None:
            return recording
    return None


class RecordedRows:
    """A ``materialize.RowReader`` that rebuilds each parameter from the recording and returns its rows.

    ``collectives`` (``sync_module_states``): rank 0 rebuilds each parameter and broadcasts it; every
    rank keeps its rows of rank 0's values. Every rank must ask for the same parameters in the same
    order (``fill_shards`` does).
    """

    def __init__(self, recording: InitRecording, module: nn.Module, collectives: Any = None,
                 device: torch.device | None = None) -> None:
        self.recording = recording
        self.by_name = dict(module.named_parameters(remove_duplicate=False))
        self.collectives = collectives
        self.device = device

    def __call__(self, names: list[str], start: int, stop: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        meta = self.by_name[names[0]]
        if self.collectives is None or self.collectives.world_size == 1:
            full = self._rebuild(names[0], meta)
        else:
            full = torch.empty(shape, dtype=dtype, device=self.device)
            if self.collectives.rank == 0:
                full.copy_(self._rebuild(names[0], meta))
            self.collectives.broadcast(full, src=0, tag=f"broadcast of rank 0's initial {names[0]}")
            full = full.cpu()
        return full.reshape(1)[start:stop] if len(shape) == 0 else full[start:stop]

    def _rebuild(self, name: str, meta: torch.Tensor) -> torch.Tensor:
        try:
            return self.recording.materialize(meta)
        except RuntimeError as exc:
            if "outside the sharded_init block" in str(exc):
                raise RuntimeError(
                    f"sharded_init: parameter {name!r} was changed after the sharded_init block (e.g. by "
                    "model.to(dtype)), so its value cannot be rebuilt: do such changes inside the block, build "
                    "in the dtype you want (torch.set_default_dtype), or cast after prepare()") from None
            raise
