"""Checkpoints of a training job: ``Accelerator.save_state`` / ``load_state`` and their files.

- ``save_load``: what a checkpoint holds and the save / load / resume of a whole job (agreement across
  the ranks, commit, rotation), asking ``format_registry`` for the format;
- ``format_registry``: the format of each ``state_dict_type`` and of each foreign folder (adding a format:
  one file and one registration line there); ``format_protocol``: what a format is; ``load_plan``: what a
  format's read returns; ``writer``: the ``Writer`` every file goes through and ``SizeWriter`` (a dry run);
- ``own_formats``: xshard's ``full``, ``sharded`` and ``local`` formats; ``job_files``: the files they all
  write beside the model and optimizer (RNG, schedulers, data loaders, scaler, registered objects, config);
- ``formats``: model and optimizer state as row tables (full, local, sharded layouts);
- ``files``: atomic folders, checksums, the manifest, finding and rotating checkpoints;
- ``tensorfile``: one-pass writing of safetensors and torch files, hashed as they are written;
- ``foreign``: folders written by Accelerate's ``save_state`` (FSDP and DDP), read by rows through
  ``sources`` (state dicts, safetensors files and torch.distributed.checkpoint folders by rows);
- ``trainer_folder``: ``checkpoint-N`` folders written by the stock transformers Trainer, read the same way;
- ``consolidate``: one state dict (or a ``from_pretrained`` folder) from any checkpoint, no process group;
- ``progress``: progress bars for the slow parts, on the main process.
"""

from .files import CheckpointError, CheckpointMismatchError, latest_checkpoint
from .save_load import load_state, resume, save_state

__all__ = ["CheckpointError", "CheckpointMismatchError", "latest_checkpoint", "load_state", "resume", "save_state"]
