"""The xshard Accelerator a transformers Trainer runs on, and what the Trainer reads around it.

``build_accelerator(args)`` makes the job's Accelerator from any ``TrainingArguments`` (xshard's, stock, TRL's
``SFTConfig``) through ``sharding_config(args)``, with the settings the Trainer's own loop needs:

- accumulation 1 and no clipping in the Accelerator: the Trainer counts its accumulation window itself
  (``gradient_state._set_sync_gradients``, ``no_sync``), divides the loss, and clips with ``max_grad_norm``
  (the stock Trainer gives Accelerate ``num_steps=1`` for the same reason);
- the data order of the stock Trainer: Accelerate's seedable sampler (``use_seedable_sampler``, the stock
  Trainer's default), its ``RandomSampler`` drawn from ``data_seed`` (else the seed the Trainer set) plus the
  epoch, so one process reads the batches the stock Trainer reads;
- precision from the config; where the device cannot compute in it, one warning and fp32 (arguments that
  are not xshard's never checked the device);
- ``--torch_compile``: the stock Trainer's ``TorchDynamoPlugin`` (``trainer_dynamo_plugin``), with which
  ``prepare`` compiles the sharded model.

``bind_arguments`` makes stock arguments agree with the job: their ``world_size``, ``process_index``,
``device`` and ``should_save`` then answer from xshard's backend (stock arguments on a CPU under a launcher
otherwise see one process of one, on every rank). What it attaches (an ``XShardDistributedState``, the device,
``_n_gpu``) leaves ``torch.save(args)`` (the Trainer's ``training_args.bin``), ``copy.deepcopy``, ``to_dict``
and ``to_json_string`` working: the state pickles as its values and copies as a view of the same job.

``TrainerAccelerator.free_memory`` keeps the prepared model and optimizer: the Trainer calls it at the start
of every ``train()``, and a sharded model cannot be handed back whole in place, so the Trainer keeps training
the prepared one (its ``model_wrapped``).
"""

from __future__ import annotations

import warnings
from typing import Any

from xshard.accelerate_compat.utils import DataLoaderConfiguration, release_memory
from xshard.accelerator import Accelerator
from xshard.config import XShardConfigWarning
from xshard.config.dynamo import TorchDynamoPlugin
from xshard.runtime.data import ShardedDataLoader

__all__ = ["TrainerAccelerator", "bind_arguments", "build_accelerator", "trainer_dynamo_plugin"]


class TrainerAccelerator(Accelerator):
    """xshard's Accelerator as the Trainer uses it (see the module docstring for what differs)."""

    #: Accelerate's tensor/context/sequence-parallel layout, which Trainer subclasses (TRL's) read: none,
    #: xshard is data parallel (``sharding_config`` refuses a ``parallelism_config`` that asks for more)
    parallelism_config = None

    def free_memory(self, *objects: Any) -> list[Any]:
        """Forget the data loaders and schedulers and reset the step; keep the prepared models and
        optimizers, which the Trainer goes on using from one ``train()`` to the next."""
        self.job.schedulers.clear()
        self.job.loaders.clear()
        self.job.step = self.job.micro_step = 0
        self.job.sync_gradients = True
        return release_memory(*objects, backend=self.backend)

    clear = free_memory


def build_accelerator(args: Any) -> TrainerAccelerator:
    """The job's Accelerator for these TrainingArguments (see the module docstring)."""
    from .config import sharding_config

    config = sharding_config(args)
    wanted = config.mixed_precision
    accelerator_config = args.accelerator_config.to_dict()
    data = DataLoaderConfiguration(
        split_batches=bool(accelerator_config.get("split_batches", False)),
        dispatch_batches=accelerator_config.get("dispatch_batches"),
        even_batches=bool(accelerator_config.get("even_batches", True)),
        use_seedable_sampler=bool(accelerator_config.get("use_seedable_sampler", True)),
        data_seed=args.data_seed,
        non_blocking=bool(accelerator_config.get("non_blocking", False)),
    )
    accelerator = TrainerAccelerator(
        config=config, seed=args.seed, timeout=float(args.ddp_timeout), dataloader_config=data,
        mixed_precision="no", gradient_accumulation_steps=1, gradient_clipping=0.0,
        dynamo_plugin=trainer_dynamo_plugin(args),
    )
    _warn_of_tpu_code_paths(accelerator)
    if wanted != "no":
        if accelerator.supports(wanted):
            accelerator.mixed_precision = wanted
        elif accelerator.is_main_process:
            warnings.warn(f"{wanted} was asked for, but the {accelerator.backend.name} backend cannot compute in it on "
                          f"{accelerator.device}: training in fp32 instead", XShardConfigWarning, stacklevel=3)
    return accelerator


def trainer_dynamo_plugin(args: Any) -> TorchDynamoPlugin:
    """The ``TorchDynamoPlugin`` the stock Trainer gives its Accelerator: ``--torch_compile_backend`` (which
    ``--torch_compile`` sets to inductor) and ``--torch_compile_mode``; neither: ``ACCELERATE_DYNAMO_*``."""
    backend = getattr(args, "torch_compile_backend", None)
    return TorchDynamoPlugin(backend=backend, mode=getattr(args, "torch_compile_mode", None),
                             dynamic=False if backend == "neuron" else None)  # neuron: static shapes only


def _warn_of_tpu_code_paths(accelerator: Accelerator) -> None:
    """One warning where transformers takes its TPU code paths (torch_xla importable) but the job runs on
    another backend: ``xshard launch`` prevents it (``Backend.default_env``), a plain torchrun does not."""
    from transformers.utils import is_torch_xla_available

    # the backend says whether transformers' TPU paths should be off (Backend.default_env: all but xla's)
    wants_off = accelerator.backend.default_env().get("USE_TORCH_XLA") == "0"
    if wants_off and is_torch_xla_available() and accelerator.is_main_process:
        warnings.warn(
            f"torch_xla is installed, so transformers takes its TPU code paths while xshard runs on the "
            f"{accelerator.backend.name} backend: the logged loss would be rank 0's alone (xm.mesh_reduce gathers "
            "nothing across these processes). Set USE_TORCH_XLA=0 before transformers is imported (xshard launch "
            "does), or use an environment without torch_xla", XShardConfigWarning, stacklevel=3)


def bind_arguments(args: Any, accelerator: Accelerator) -> None:
    """Make ``args`` answer where this process sits from ``accelerator``'s backend (stock arguments)."""
    from .arguments import XShardDistributedState, process_gpu_count

    if isinstance(getattr(args, "distributed_state", None), XShardDistributedState):
        return  # xshard's arguments: already the backend's answers
    args.distributed_state = XShardDistributedState(accelerator.backend)
    args.__dict__["_setup_devices"] = accelerator.device  # the cached property the Trainer reads as args.device
    args._n_gpu = process_gpu_count(accelerator.backend)  # as the stock arguments count (never DataParallel)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """The Trainer's resume skip: a prepared loader starts its current epoch at batch ``num_batches``
    (``ShardedDataLoader.skip_first_batches``); any other loader goes to Accelerate's function."""
    if isinstance(dataloader, ShardedDataLoader):
        return dataloader.skip_first_batches(num_batches)
    return _ACCELERATE_SKIP(dataloader, num_batches)


def _install_skip_first_batches() -> Any:
    """Route ``transformers.trainer.skip_first_batches`` (Accelerate's, which rebuilds a torch DataLoader
    from a prepared loader's sampler) through ``skip_first_batches`` above.

    Design note: the Trainer's ``_run_epoch`` looks the name up in its module at each resume, and copying
    that method to change one line would fork it from transformers. The replacement hands every loader
    that is not xshard's to the original function, so a stock Trainer in the same process is unaffected.
    """
    import transformers.trainer as hf_trainer

    current = hf_trainer.skip_first_batches
    original = getattr(current, "__wrapped_accelerate__", current)
    skip_first_batches.__wrapped_accelerate__ = original  # type: ignore[attr-defined]
    hf_trainer.skip_first_batches = skip_first_batches
    return original


_ACCELERATE_SKIP = _install_skip_first_batches()
