"""``TrainingArguments``: transformers' class with the Trainer's meaning of each argument, on xshard.

``from xshard.trainer import TrainingArguments`` replaces ``from transformers import TrainingArguments``;
nothing else in a script changes. What differs from the stock class:

- Devices: the processes, the device and the process group are xshard's backend's (``XSHARD_BACKEND``,
  ``--use_cpu`` = the cpu backend), not Accelerate's ``PartialState``; ``world_size``, ``process_index``,
  ``device``, ``parallel_mode`` and ``main_process_first`` answer from it, under ``xshard launch``,
  ``torchrun`` or torch_xla's launcher alike; ``n_gpu`` is the stock class's count (``process_gpu_count``).
- ``--deepspeed ds_config.json`` (a path, a dict or JSON text) is read by xshard: DeepSpeed need not be
  installed (the stock class imports it here). ``deepspeed_plugin`` and ``hf_deepspeed_config`` stay None.
- ``--fsdp "full_shard auto_wrap offload"``: the words are read by xshard (hybrid_shard and no_shard too;
  transformers 5 turns them into ``fsdp_config`` entries and ``fsdp=True``), and stay in ``fsdp`` as given
  (also in ``xshard_fsdp_words``, as a list).
- ``--bf16`` / ``--fp16``: mixed precision where the device computes in that dtype (also on CPUs, which
  the stock class refuses without ``--use_cpu``); where it cannot, one warning and an fp32 run
  (``xshard_precision_fallback`` names what was asked).
- The openMind guide's transformers-4 names still parse: ``--warmup_ratio R`` is ``--warmup_steps R`` (a
  number < 1 is a ratio in transformers 5) and ``--evaluation_strategy`` is ``--eval_strategy``.
- The sharding config (``sharding_config(args)``) is built once here, so a bad value fails when the
  arguments are parsed, with an ``XShardConfigError`` naming it and the fix.

Other argument classes join with the mixin, e.g. TRL's::

    @dataclass
    class MyConfig(TrainingArgumentsMixin, trl.SFTConfig):
        pass
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import transformers

from xshard.config import XShardConfigWarning, parse_text
from xshard.config.fsdp import hf_fsdp_items
from xshard.config.precision_names import torch_dtype

from .config import sharding_config

if TYPE_CHECKING:  # the checker reads the mixin's members on the arguments it joins; at run time its base is object
    from transformers import TrainingArguments as _ArgumentsHost
else:
    _ArgumentsHost = object

__all__ = ["Seq2SeqTrainingArguments", "TrainingArguments", "TrainingArgumentsMixin", "XShardDistributedState",
           "process_gpu_count"]


def _torch_has_accelerator() -> bool:
    """torch's own test before it pins a loader's memory (its DataLoader asks the same)."""
    try:
        return bool(torch.accelerator.is_available())
    except RuntimeError:  # a PrivateUse1 device whose hooks were never registered: nothing to pin for
        return False


def process_gpu_count(backend: Any) -> int:
    """``args.n_gpu`` as the stock arguments report it for a process of ``backend`` (its ``trainer_device_count``):
    0 on a CPU (one process, or Accelerate's multi-CPU job, which needs ``--use_cpu``) and on an XLA device; 1 on
    any other device.

    Design note: the Trainer reads it as the number of devices this process drives with DataParallel (and
    ``train_batch_size`` = ``per_device_train_batch_size`` x ``max(1, n_gpu)``); a stock single process on a
    machine with several GPUs reports all of them and wraps the model in DataParallel, which xshard never
    does: one device per process, so 1 there."""
    return int(backend.trainer_device_count)


class XShardDistributedState:
    """``args.distributed_state``: where this process sits, answered by xshard's backend.

    The members the arguments and the Trainer read from Accelerate's ``PartialState``.

    Design note: the backend is this process's place in the running job (its process group, store,
    collectives and their locks and watchdog thread), and none of that can be saved or copied; yet the
    Trainer writes its arguments with ``torch.save(self.args)`` (``training_args.bin``, in every checkpoint
    and in ``save_model``'s folder) and scripts copy them (``copy.deepcopy``). So, on any arguments class
    that holds this state (xshard's own, or stock and TRL arguments that ``bind_arguments`` bound):

    - a copy (``copy.copy``, ``copy.deepcopy``) answers from the same backend: the process has one place in
      the job, as every ``PartialState`` of a process shares Accelerate's one state;
    - a pickle (``torch.save``, ``pickle``) keeps what the state answers and not the backend, as a pickled
      ``PartialState`` keeps its values: unpickled, it describes the saving process (its rank, world
      size, device, distributed type) and is joined to no job, so ``wait_for_everyone`` on more than one
      process raises instead of waiting for peers that are not there.

    ``to_dict`` and ``to_json_string`` never see the state: they read the dataclass fields only.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    @property
    def num_processes(self) -> int:
        return self.backend.world.world_size

    @property
    def process_index(self) -> int:
        return self.backend.world.rank

    @property
    def local_process_index(self) -> int:
        return self.backend.world.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.backend.world.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.backend.world.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.backend.world.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.backend.world.use_distributed

    @property
    def device(self) -> torch.device:
        return self.backend.device()

    @property
    def distributed_type(self) -> Any:
        from xshard.accelerate_compat.accelerator_state import DistributedType, data_parallel_type

        if self.num_processes == 1:
            return DistributedType.NO
        return data_parallel_type(self.backend)

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            self.backend.collectives.barrier()

    def __copy__(self) -> XShardDistributedState:
        return type(self)(self.backend)  # the same place in the same job (see the design note)

    def __deepcopy__(self, memo: dict[int, Any]) -> XShardDistributedState:
        return self.__copy__()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), (SavedPlace.of(self.backend),)  # the values, not the backend (see the design note)

    def __repr__(self) -> str:
        return (f"XShardDistributedState(backend={self.backend.name}, process {self.process_index} of "
                f"{self.num_processes}, device {self.device})")


@dataclass(frozen=True)
class SavedPlace:
    """What a pickled ``XShardDistributedState`` keeps of its backend: the members the state reads, as
    they were when it was pickled (see ``XShardDistributedState``'s design note)."""

    name: str
    device_type: str
    world: Any  # xshard.backends.world.World, a frozen dataclass of numbers and names
    device_name: str  # str(torch.device): loads where the device's runtime is not installed

    @classmethod
    def of(cls, backend: Any) -> SavedPlace:
        """The place ``backend`` (a Backend, or a SavedPlace pickled again) answers now."""
        return cls(backend.name, backend.device_type, backend.world, str(backend.device()))

    def device(self) -> torch.device:
        return torch.device(self.device_name)

    @property
    def collectives(self) -> Any:
        raise RuntimeError(
            f"these arguments were unpickled (training_args.bin): their distributed_state describes process "
            f"{self.world.rank} of the {self.world.world_size} of the {self.name} job that saved them, and is joined "
            "to no job, so it cannot wait for the other processes; arguments built in this job answer from it")


class TrainingArgumentsMixin(_ArgumentsHost):
    """Gives any ``transformers.TrainingArguments`` subclass xshard's meaning (see the module docstring).

    Put it first: ``class MyConfig(TrainingArgumentsMixin, SFTConfig)``."""

    #: what ``sharding_config`` asks to know that the devices are xshard's
    xshard_arguments = True

    if TYPE_CHECKING:  # the stock arguments this mixin rewrites (declared for the checker only)
        deepspeed: Any
        fsdp: Any
        warmup_steps: Any
        eval_strategy: Any
        bf16: bool
        fp16: bool
        bf16_full_eval: bool

    def __post_init__(self) -> None:
        self._rename_transformers4_arguments()
        # The stock class imports DeepSpeed for --deepspeed and translates the --fsdp words itself:
        # xshard reads both, so the stock code sees neither.
        deepspeed, fsdp = self.deepspeed, self.fsdp
        words = hf_fsdp_items(fsdp) if fsdp and fsdp is not True else None
        self.deepspeed = None
        if words is not None:
            self.fsdp = True
        try:
            super().__post_init__()
        finally:
            # as the user gave them: a copy (dataclasses.replace) reads them again. No --fsdp keeps the stock
            # class's own empty value (transformers 5.6 makes it [] and its Trainer takes len() of it).
            self.deepspeed = deepspeed
            if fsdp:
                self.fsdp = fsdp
        self.xshard_fsdp_words = words
        self.deepspeed_plugin = None
        self.hf_deepspeed_config = None
        self._fall_back_precision()
        sharding_config(self)  # a bad value fails now, naming it; warnings once

    def _rename_transformers4_arguments(self) -> None:
        ratio = getattr(self, "warmup_ratio", None)
        if ratio is not None:
            if self.warmup_steps not in (0, 0.0, None) and self.warmup_steps != ratio:
                raise ValueError(f"--warmup_ratio {ratio} and --warmup_steps {self.warmup_steps} both set the warmup: "
                                 "give one (in transformers 5 --warmup_steps below 1 is a ratio)")
            if not 0 <= float(ratio) < 1:
                raise ValueError(f"--warmup_ratio {ratio}: a ratio of the total steps in [0, 1) is expected")
            self.warmup_steps = float(ratio)
        old = getattr(self, "evaluation_strategy", None)
        if old is not None:
            new = str(getattr(self.eval_strategy, "value", self.eval_strategy))
            old = str(getattr(old, "value", old))
            if new not in ("no", old):
                raise ValueError(f"--evaluation_strategy {old} and --eval_strategy {new} disagree: give one "
                                 "(--eval_strategy is the transformers 5 name)")
            self.eval_strategy = old

    def _validate_args(self) -> None:
        # The stock check refuses bf16 on a device without CUDA bf16 unless --use_cpu; xshard asks the
        # backend instead (_fall_back_precision), once the device is known.
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are both set: choose one")
        bf16, bf16_full_eval = self.bf16, self.bf16_full_eval
        self.bf16 = self.bf16_full_eval = False
        try:
            super()._validate_args()
        finally:
            self.bf16, self.bf16_full_eval = bf16, bf16_full_eval

    def _fall_back_precision(self) -> None:
        """--bf16/--fp16 where the device cannot compute in that dtype: one warning, and fp32."""
        self.xshard_precision_fallback = None
        wanted = "bf16" if self.bf16 else "fp16" if self.fp16 else None
        backend = self.distributed_state.backend
        if wanted is None or backend.supports(torch_dtype(wanted)):
            return
        if backend.world.is_main_process:
            hint = " (--fp16 gives mixed precision here)" if wanted == "bf16" and backend.supports(torch.float16) else ""
            warnings.warn(f"--{wanted} was asked for, but the {backend.name} backend cannot compute in "
                          f"{torch_dtype(wanted)} on {backend.device()}: training in fp32 instead{hint}",
                          XShardConfigWarning, stacklevel=4)
        self.xshard_precision_fallback = wanted
        self.bf16 = self.fp16 = False
        self.mixed_precision = "no"

    def _xla_fsdp(self) -> bool:
        """The fsdp_config asks for torch_xla's FSDP (``xla: true``); read before transformers loads the file."""
        options = self.fsdp_config
        if isinstance(options, (str, os.PathLike)) and self.fsdp:
            from xshard.config.source import read_bytes

            options = parse_text(read_bytes(options), os.fspath(options))
        if not isinstance(options, dict):
            return False
        return str(options.get("xla", options.get("fsdp_xla", False))).strip().lower() == "true"

    @functools.cached_property
    def _setup_devices(self) -> torch.device:
        """Join the job through xshard's backend (the stock class builds Accelerate's PartialState)."""
        from xshard.backends import select

        backend = select("cpu" if self.use_cpu else "xla" if self._xla_fsdp() else None).cls()
        backend.init_process_group(timeout=float(self.ddp_timeout))
        self.distributed_state = XShardDistributedState(backend)
        device = backend.device()
        self._n_gpu = process_gpu_count(backend)
        if not _torch_has_accelerator():
            self.dataloader_pin_memory = False  # nothing to pin for (torch warns at every loader otherwise)
        return device

    @property
    def xshard_config(self) -> Any:
        """The ``XShardConfig`` of this run (``sharding_config(self)``)."""
        return sharding_config(self)


@dataclass
class TrainingArguments(TrainingArgumentsMixin, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` on xshard (see the module docstring); also takes the
    transformers-4 names the openMind guide uses."""

    warmup_ratio: float | None = field(
        default=None, metadata={"help": "transformers 4's name: the same as --warmup_steps with a value below 1 "
                                        "(a ratio of the total training steps)"})
    evaluation_strategy: str | None = field(
        default=None, metadata={"help": "transformers 4's name of --eval_strategy"})

    def to_dict(self) -> dict[str, Any]:
        """As the stock class, without the transformers-4 aliases (their values are in the new names)."""
        data = super().to_dict()
        for name in ("warmup_ratio", "evaluation_strategy"):
            data.pop(name, None)
        return data



@dataclass
class Seq2SeqTrainingArguments(TrainingArguments, transformers.Seq2SeqTrainingArguments):
    """``transformers.Seq2SeqTrainingArguments`` on xshard: ``TrainingArguments``' meanings, plus the
    generation arguments (``predict_with_generate``, ``generation_max_length``, ...)."""
