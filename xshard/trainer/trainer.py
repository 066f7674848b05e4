"""``Trainer`` and ``TrainerMixin``: the transformers Trainer's whole loop on xshard's Accelerator.

```python
from xshard.trainer import Trainer, TrainingArguments        # was: from transformers import ...

class MySFTTrainer(xshard.trainer.TrainerMixin, trl.SFTTrainer):  # any other Trainer subclass
    pass
```

The mixin does what the vendor trainers do (Optimum Habana's, Optimum Neuron's): it builds its own
Accelerate-compatible Accelerator in ``create_accelerator_and_postprocess`` and overrides the checkpoint
hooks. Everything else is the Trainer's own code: data loading, the loss and its accumulation, clipping,
the optimizer and scheduler it creates, logging, callbacks, evaluation.

Design notes:
- xshard plays the part the Trainer gives DDP: ``is_deepspeed_enabled``, ``is_fsdp_enabled`` and the XLA
  FSDP flags always read False, so none of the Trainer's DeepSpeed / FSDP / torch_xla-FSDP branches run;
  the sharding (at the config's stage, on every backend) happens in ``accelerator.prepare(model,
  optimizer)``. ``self.model`` stays the user's module (its Parameters hold this rank's shards) and
  ``self.model_wrapped`` is the prepared model, as under DDP.
- The model is not moved to the device before ``prepare``: each rank's shard is placed there.
- Checkpoints: ``xshard.trainer.checkpoints`` (the xshard state inside the Trainer's ``checkpoint-N``).
  ``save_model()`` writes the whole weights (gathered to the main process) with ``save_pretrained``, the
  tokenizer and ``training_args.bin``, as the stock Trainer does; a PEFT model writes its adapter.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..runtime.throughput import throughput_values
from . import checkpoints
from .accelerator_setup import bind_arguments, build_accelerator
from .trl_generation import route_trl_generation

if TYPE_CHECKING:  # the checker reads the mixin's members on the Trainer it joins; at run time its base is object
    from transformers import Trainer as _TrainerHost
else:
    _TrainerHost = object

__all__ = ["Seq2SeqTrainer", "Trainer", "TrainerMixin"]


def _always_false(name: str) -> property:
    """A Trainer flag that reads False whatever the Trainer assigns (see the module's design notes)."""

    def get(self: Any) -> bool:
        return False

    def set_(self: Any, value: Any) -> None:
        pass  # the Trainer assigns these from its arguments; on xshard the branch they select never runs

    return property(get, set_, doc=f"``{name}``: always False on xshard (xshard's Accelerator shards the model).")


def _xla_fsdp_flag() -> property:
    """``is_fsdp_xla_enabled``: False, except while the Trainer's ``__init__`` runs, where it is what the
    Trainer assigned (an XLA ``fsdp_config``).

    Design note: ``Trainer.__init__`` refuses ``--fsdp`` unless every device has a DDP-style process
    (``ParallelMode.DISTRIBUTED``) or its own XLA FSDP wraps the model; torch_xla's processes are
    ``ParallelMode.TPU``, so a TPU user's ``--fsdp ... --fsdp_config '{"xla": true}'`` would be refused.
    xshard shards in every mode, so that check is answered as the stock Trainer answers it for an XLA FSDP
    run; after ``__init__`` the flag reads False and no torch_xla-FSDP branch runs.
    """

    def get(self: Any) -> bool:
        return bool(self.__dict__.get("_xshard_in_init") and self.__dict__.get("_xshard_fsdp_xla"))

    def set_(self: Any, value: Any) -> None:
        self.__dict__["_xshard_fsdp_xla"] = bool(value)

    return property(get, set_, doc=get.__doc__)


class TrainerMixin(_TrainerHost):
    """Runs a ``transformers.Trainer`` (or a subclass) on xshard: put it first in the bases."""

    is_deepspeed_enabled = _always_false("is_deepspeed_enabled")
    is_fsdp_enabled = _always_false("is_fsdp_enabled")
    is_fsdp_xla_enabled = _xla_fsdp_flag()
    is_fsdp_xla_v1_enabled = _always_false("is_fsdp_xla_v1_enabled")
    is_fsdp_xla_v2_enabled = _always_false("is_fsdp_xla_v2_enabled")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_xshard_in_init"] = True  # see _xla_fsdp_flag
        try:
            super().__init__(*args, **kwargs)
        finally:
            self.__dict__["_xshard_in_init"] = False

    # ------------------------------------------------------------------ the Accelerator
    def create_accelerator_and_postprocess(self) -> None:
        """Build xshard's Accelerator from the arguments (``sharding_config``) and bind the arguments'
        view of the processes to it."""
        self.accelerator = build_accelerator(self.args)
        bind_arguments(self.args, self.accelerator)
        route_trl_generation(self.args, self.accelerator)
        self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                 use_gather_object=self.args.eval_use_gather_object)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log line; a training line (one with ``loss``) also carries this rank's throughput since
        the last one: ``train_tokens_per_second_per_device``, ``train_tflops_per_device`` and ``mfu``
        (``Accelerator.throughput``; none before a step is timed)."""
        if "loss" in logs:
            rates = throughput_values(self.accelerator.throughput(), "train_")
            if "train_mfu" in rates:
                rates["mfu"] = rates.pop("train_mfu")
            logs = {**logs, **rates}
        super().log(logs, *args, **kwargs)

    @property
    def gather_function(self) -> Any:
        """How evaluation gathers per-sample values: ``gather_for_metrics`` (the loader's order, each sample once).

        Design note: ``Seq2SeqTrainer.evaluate``/``predict`` set the plain ``accelerator.gather`` here.
        Accelerate gives each process whole consecutive batches, so a plain gather keeps the data set's
        order (with the last batch's wrap-around repeats at the end); xshard interleaves the samples
        over the ranks, so on several processes a plain gather would put predictions out of the data set's
        order: there that one assignment is read as ``gather_for_metrics``. On one process nothing is
        interleaved or repeated and the plain gather is kept, so every figure is the stock class's (its
        ``eval_loss`` weighs the last, short batch as a whole one: ``loss.repeat(batch_size)`` kept whole).
        Any other function is kept as given.
        """
        return self.__dict__.get("_xshard_gather_function")

    @gather_function.setter
    def gather_function(self, function: Any) -> None:
        accelerator = self.__dict__.get("accelerator")
        if accelerator is not None and function == accelerator.gather and accelerator.num_processes > 1:
            function = functools.partial(accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object)
        self.__dict__["_xshard_gather_function"] = function

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing: ``prepare`` places each rank's shard on its device (the whole model never is)."""

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The prepared model when there is one (``prepare`` shards; nothing else wraps)."""
        prepared = self._prepared_model()
        return prepared if prepared is not None else super()._wrap_model(model, training, dataloader)

    def _prepared_model(self) -> Any:
        """The prepared (sharded) model holding ``self.model``, or None before ``prepare``."""
        for prepared in self.accelerator._models:
            if prepared is self.model or getattr(prepared, "module", None) is self.model:
                return prepared
        return None

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Whole weights that ``from_pretrained`` loads (a PEFT model: its adapter), the tokenizer and the
        arguments; every process must call it. Inside a checkpoint: xshard's state of the job instead."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if getattr(self, "_xshard_saving_checkpoint", False):
            self._save_job_state(output_dir)
            return
        prepared = self._prepared_model()
        state_dict = self.accelerator.get_state_dict(prepared) if prepared is not None else None
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint (its ``save_model`` call writes xshard's state; see ``checkpoints``);
        ``save_total_limit`` rotates with ``checkpoints.rotate`` (a symbolic link is never counted)."""
        limit = self._xshard_save_total_limit = self.args.save_total_limit
        self._xshard_saving_checkpoint = True
        self.args.save_total_limit = None  # the stock rotation counts links: xshard's runs below instead
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._xshard_saving_checkpoint = False
            self.args.save_total_limit = limit
        if self.args.should_save and limit is not None and limit > 0:
            run_dir = self._get_output_dir(trial=trial)
            newest = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            checkpoints.rotate(run_dir, limit, newest, self.state.best_model_checkpoint)

    def _save_job_state(self, output_dir: str) -> None:
        checkpoints.save_job_state(self.accelerator.job, output_dir, self.lr_scheduler,
                                   with_optimizer=not self.args.save_only_model)
        if _is_peft_model(self.model):
            # as in the stock Trainer's checkpoints, the adapter alone too (what PeftModel.from_pretrained loads)
            state_dict = self.accelerator.get_state_dict(self._prepared_model())
            if self.args.should_save:
                self.model.save_pretrained(output_dir, state_dict=state_dict)
        if not self.args.should_save:
            return
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        args = copy.copy(self.args)  # the arguments as given (_save_checkpoint holds back save_total_limit)
        args.save_total_limit = self._xshard_save_total_limit
        torch.save(args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing: the optimizer and scheduler are in the checkpoint's xshard state already."""

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the fp16 grad scaler is in the checkpoint's xshard state."""

    # ------------------------------------------------------------------ resuming
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; ``resume_from_checkpoint=True`` takes the newest complete checkpoint."""
        if resume_from_checkpoint is True:
            found = checkpoints.latest(self.args.output_dir)
            if found is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir}): "
                                 "train without resume_from_checkpoint for a first run")
            resume_from_checkpoint = str(found)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing yet: the checkpoint is loaded once the model is prepared (``_load_optimizer_and_scheduler``)."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load the model, optimizer, scheduler, scaler and step from the checkpoint's xshard state."""
        if checkpoint is not None:
            checkpoints.load_job_state(self.accelerator.job, checkpoint, self.lr_scheduler)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing: ``_load_optimizer_and_scheduler`` restored the fp16 grad scaler."""

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights into the prepared model."""
        checkpoints.load_model_weights(self._prepared_model(), self.state.best_model_checkpoint)


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class Trainer(TrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` on xshard: the same arguments and behaviour, sharded at the config's stage."""


class Seq2SeqTrainer(TrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` on xshard: ``predict_with_generate`` generates at every stage (at
    stage 3 each rank gathers the units as the steps need them, every rank stepping until all are done)."""


# The mixin overrides these Trainer methods; a transformers release that renames one would silently
# bypass xshard's version, so the import fails instead, naming it.
_HOOKS = ("create_accelerator_and_postprocess", "_move_model_to_device", "_wrap_model", "save_model",
          "_save_checkpoint", "_save_optimizer_and_scheduler", "_save_scaler", "_load_from_checkpoint",
          "_load_optimizer_and_scheduler", "_load_scaler", "_load_best_model", "_save", "train")
_missing = [name for name in _HOOKS if not inspect.isfunction(getattr(transformers.Trainer, name, None))]
if _missing:
    raise ImportError(f"xshard.trainer: transformers {transformers.__version__}'s Trainer has no {', '.join(_missing)}; "
                      "this xshard supports the Trainer of transformers 5.x")
