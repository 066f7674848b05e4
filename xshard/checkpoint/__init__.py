"""Checkpoints of a training job: ``Accelerator.save_state`` / ``load_state`` and their files.

- ``state``: what a checkpoint holds and the save / load / resume of a whole job;
- ``formats``: model and optimizer state by ``state_dict_type`` (full, local, sharded row tables);
- ``files``: atomic folders, checksums, the manifest, finding and rotating checkpoints;
- ``consolidate``: one state dict (or a ``from_pretrained`` folder) from any checkpoint, no process group.
"""

from .files import CheckpointError, CheckpointMismatchError, latest_checkpoint
from .state import load_state, resume, save_state

__all__ = ["CheckpointError", "CheckpointMismatchError", "latest_checkpoint", "load_state", "resume", "save_state"]
