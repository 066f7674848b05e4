"""Checkpoints of a training job: ``Accelerator.save_state`` / ``load_state`` and their files.

- ``save_load``: what a checkpoint holds and the save / load / resume of a whole job;
- ``formats``: model and optimizer state by ``state_dict_type`` (full, local, sharded row tables);
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
