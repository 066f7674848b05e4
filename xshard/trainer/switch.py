"""The no-edit switch: every ``transformers.Trainer`` and ``TrainingArguments`` (and every subclass of either)
built in this process runs on xshard, as if its class had ``TrainerMixin`` / ``TrainingArgumentsMixin`` first
in its bases.

``install()`` is what ``xshard launch --trainer`` and ``python -m xshard.trainer.patch`` do in each process
before the program runs; a program that imports xshard may call it itself. After it:

- ``SomeTrainer(...)`` (``transformers.Trainer``, TRL's ``SFTTrainer``, a program's own subclass) builds an
  instance of ``class SomeTrainer(TrainerMixin, SomeTrainer)``: xshard's Accelerator and checkpoint hooks,
  the Trainer's own code for everything else (see ``xshard.trainer.trainer``).
- ``SomeArguments(...)`` (any ``transformers.TrainingArguments`` subclass, also those ``HfArgumentParser``
  builds) gets ``TrainingArgumentsMixin``: ``--deepspeed`` read without DeepSpeed, the ``--fsdp`` words,
  ``--bf16`` with the device check, and transformers 4's ``--warmup_ratio`` / ``--evaluation_strategy``
  where the class has no such field (``HfArgumentParser`` accepts them).
- Without ``--deepspeed``/``--fsdp`` in the arguments, the sharding config is the launcher's ``--config``
  (``XSHARD_CONFIG``: xshard's, an accelerate yaml, or a ds_config whose "auto" values the arguments fill).

Design note: the classes are swapped when an instance is made (a ``__new__`` on the two stock base classes),
not when a subclass is defined, so classes defined before ``install()`` and in modules the program imports
later are treated alike, and ``isinstance(trainer, SFTTrainer)`` holds. The xshard class of a stock class is
made once and keeps its name and module; its instances pickle as the stock class (``training_args.bin``
loads where xshard is not installed) and copy as themselves.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import functools
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["ENV_VAR", "install", "installed", "xshard_arguments_class", "xshard_trainer_class"]

#: set to 1 in every process the switch is on in (``xshard launch --trainer`` sets it for its processes;
#: given to ``xshard launch`` itself, it turns the switch on as ``--trainer`` does)
ENV_VAR = "XSHARD_TRAINER"

# transformers 4's names xshard's TrainingArguments still takes (``TrainingArgumentsMixin`` reads them)
_TRANSFORMERS4_FIELDS = (
    ("warmup_ratio", float | None, dataclasses.field(default=None, metadata={
        "help": "transformers 4's name: the same as --warmup_steps with a value below 1 (a ratio of the total "
                "training steps)"})),
    ("evaluation_strategy", str | None, dataclasses.field(default=None, metadata={
        "help": "transformers 4's name of --eval_strategy"})),
)

_state: dict[str, Any] = {}
# pickle's own way to make an instance without calling its class (protocol 0); loads without xshard
_RECONSTRUCTOR = copyreg._reconstructor  # type: ignore[attr-defined]


def installed() -> bool:
    """Is the switch on in this process?"""
    return bool(_state)


def install() -> None:
    """Turn the switch on in this process (see the module docstring); a second call does nothing."""
    if _state:
        return
    import transformers
    from transformers import hf_argparser

    _state["trainer_new"] = transformers.Trainer.__dict__.get("__new__")
    _state["arguments_new"] = transformers.TrainingArguments.__dict__.get("__new__")
    _state["parser_init"] = hf_argparser.HfArgumentParser.__init__
    transformers.Trainer.__new__ = staticmethod(_new_trainer)
    transformers.TrainingArguments.__new__ = staticmethod(_new_arguments)
    hf_argparser.HfArgumentParser.__init__ = _parser_init(_state["parser_init"])
    os.environ[ENV_VAR] = "1"


def uninstall() -> None:
    """Turn the switch off in this process (classes made while it was on stay xshard's)."""
    if not _state:
        return
    import transformers
    from transformers import hf_argparser

    for cls, key in ((transformers.Trainer, "trainer_new"), (transformers.TrainingArguments, "arguments_new")):
        if _state[key] is None:
            del cls.__new__
        else:
            cls.__new__ = _state[key]
    hf_argparser.HfArgumentParser.__init__ = _state["parser_init"]
    _state.clear()
    os.environ.pop(ENV_VAR, None)


def _new_trainer(cls: type, *args: Any, **kwargs: Any) -> Any:
    return object.__new__(xshard_trainer_class(cls))


def _new_arguments(cls: type, *args: Any, **kwargs: Any) -> Any:
    return object.__new__(xshard_arguments_class(cls))


@functools.cache
def xshard_trainer_class(cls: type) -> type:
    """``class cls(TrainerMixin, cls)`` (``cls`` itself when it has the mixin already)."""
    from .trainer import TrainerMixin

    if issubclass(cls, TrainerMixin):
        return cls
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (TrainerMixin, cls), namespace)


@functools.cache
def xshard_arguments_class(cls: Any) -> Any:
    """``class cls(TrainingArgumentsMixin, cls)`` as a dataclass, with transformers 4's argument names the
    class lacks (``cls`` itself when it has the mixin already)."""
    from .arguments import TrainingArgumentsMixin

    if issubclass(cls, TrainingArgumentsMixin):
        return cls
    have = {f.name for f in dataclasses.fields(cls)}
    added = tuple(name for name, _, _ in _TRANSFORMERS4_FIELDS if name not in have)
    fields = [(name, kind, _copy_field(spec)) for name, kind, spec in _TRANSFORMERS4_FIELDS if name in added]

    def to_dict(self: Any) -> dict[str, Any]:
        data = super(made, self).to_dict()
        for name in added:  # their values are in the new names already
            data.pop(name, None)
        return data

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # the stock class, made without calling it (as pickle's protocol 0 does), and this instance's state
        reduced = super(made, self).__reduce_ex__(protocol)
        state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else dict(self.__dict__)
        return _RECONSTRUCTOR, (cls, object, None), state

    def __copy__(self: Any) -> Any:
        new: Any = object.__new__(made)
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self: Any, memo: dict[int, Any]) -> Any:
        new: Any = object.__new__(made)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    namespace = {"__module__": cls.__module__, "__doc__": cls.__doc__, "to_dict": to_dict,
                 "__reduce_ex__": __reduce_ex__,
                 "__copy__": __copy__, "__deepcopy__": __deepcopy__}
    made: Any = dataclasses.make_dataclass(cls.__name__, fields, bases=(TrainingArgumentsMixin, cls), namespace=namespace)
    made.__qualname__ = cls.__qualname__
    return made


def _copy_field(spec: Any) -> Any:
    return dataclasses.field(default=spec.default, metadata=dict(spec.metadata))


def _parser_init(original: Any) -> Any:
    """``HfArgumentParser.__init__`` that parses into the xshard class of each TrainingArguments class."""
    import transformers

    @functools.wraps(original)
    def init(self: Any, dataclass_types: Any = None, **kwargs: Any) -> None:
        if dataclass_types is not None:
            given = [dataclass_types] if not isinstance(dataclass_types, Iterable) else list(dataclass_types)
            dataclass_types = [xshard_arguments_class(t) if isinstance(t, type)
                               and issubclass(t, transformers.TrainingArguments) else t for t in given]
        original(self, dataclass_types, **kwargs)

    return init
