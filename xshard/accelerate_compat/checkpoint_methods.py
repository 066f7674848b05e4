"""The Accelerator's checkpoint methods: what a checkpoint holds, where a loader resumes, save and load.

``CheckpointMethods`` is a mixin of ``xshard.Accelerator`` (as ``AccelerateSurface`` is): ``save_state`` /
``load_state`` / ``register_for_checkpointing`` / ``skip_first_batches`` in Accelerate's signatures, turned
into calls of ``xshard.checkpoint`` on the job (``JobState``) and of ``project`` for automatic checkpoint
naming. It reads only the core members ``AcceleratorCore`` declares; the core's ``prepare`` asks
``_resume_if_restarted`` once everything it holds is prepared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import auto_resume
from . import project

if TYPE_CHECKING:
    from .accelerator_core import AcceleratorCore
else:  # at run time a plain mixin: the core members come from xshard.Accelerator
    AcceleratorCore = object


class CheckpointMethods(AcceleratorCore):
    """The Accelerator's checkpoint members (see the module docstring)."""

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects' ``state_dict()`` with ``save_state`` / ``load_state``."""
        invalid = [i for i, obj in enumerate(objects)
                   if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None))]
        if invalid:
            names = ", ".join(f"item at index {i} ({type(objects[i]).__name__})" for i in invalid)
            raise ValueError(f"register_for_checkpointing: every object needs state_dict() and load_state_dict(); "
                             f"these do not: {names}")
        self.job.custom_objects.extend(objects)
        self._resume_if_restarted()

    def _resume_if_restarted(self) -> None:
        """A job restarted by ``xshard launch --max_restarts`` loads its newest checkpoint once everything
        it holds is prepared (``xshard.checkpoint.auto_resume``); an automatic checkpoint's numbering then
        goes on after the one loaded, as ``load_state()`` continues it."""
        loaded = auto_resume.resume_if_restarted(self.job, self.project_dir)
        if loaded is not None:
            project.continue_after(self.project_configuration, loaded)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The loader from batch ``num_batches`` of its current epoch on (``xshard.runtime.data``): after
        ``load_state`` restored that position, nothing more is skipped."""
        from ..runtime.data import skip_first_batches

        return skip_first_batches(dataloader, num_batches)

    def save_state(self, directory: str | os.PathLike | None = None, state_dict_type: str | None = None,
                   save_total_limit: int | None = None, async_save: bool | None = None, **kwargs: Any) -> Path:
        """Save models, optimizers, schedulers, loaders' positions, scaler, RNG, step and the objects
        given to ``register_for_checkpointing`` to ``directory``.

        Atomic: the folder appears complete or not at all. ``state_dict_type`` ("full", "local",
        "sharded"; default: the config's, "full": one plain model.safetensors, resumable on any world
        size and stage) is described in ``xshard.checkpoint.formats``.
        ``save_total_limit`` keeps only the newest N complete checkpoints in ``directory``'s parent.
        Without ``directory``, a ``ProjectConfiguration(automatic_checkpoint_naming=True)`` names it
        ``project_dir/checkpoints/checkpoint_<iteration>`` and its ``total_limit`` applies
        (``xshard.accelerate_compat.project``). Accelerate's ``safe_serialization`` is accepted (models are always
        safetensors). Every rank must call it. Returns the checkpoint's path.
        ``async_save`` (default: the config's ``async_save``): return once this rank's state is copied
        to host memory and write the files in the background (``xshard.checkpoint.async_save``); the
        next ``save_state``, ``load_state`` and ``end()`` wait for it and raise its error if it failed.
        """
        from ..checkpoint import save_state

        automatic = directory is None
        if automatic:
            if not project.enabled(self.project_configuration):
                raise ValueError("save_state() needs a folder, or ProjectConfiguration(automatic_checkpoint_naming="
                                 "True, project_dir=...) given to the Accelerator as project_config")
            directory = project.next_checkpoint(self.project_configuration)
            if save_total_limit is None:
                save_total_limit = getattr(self.project_configuration, "total_limit", None)
        background = self.job.config.async_save if async_save is None else bool(async_save)
        assert directory is not None  # named above when it was not given
        path = save_state(self.job, directory, state_dict_type, save_total_limit, async_save=background)
        auto_resume.record(path, self.local_rank)  # where a restarted job resumes from
        if automatic:
            self.project_configuration.iteration += 1
        return path

    def load_state(self, directory: str | os.PathLike | None = None, resume_from_checkpoint: bool = False, *,
                   missing_ok: bool = False, **kwargs: Any) -> Path | None:
        """Restore everything ``save_state`` wrote; returns the folder loaded.

        With ``resume_from_checkpoint=True``, ``directory`` is the output folder that holds the
        checkpoints: the newest complete one is loaded (incomplete ones are skipped with a warning).
        A folder that does not exist or holds no checkpoint is an error naming it (a mistyped path
        never restarts training from scratch); ``missing_ok=True`` instead returns None and loads
        nothing, for a script whose first run has no checkpoint yet. Without ``directory``, the newest
        automatic checkpoint of the project is loaded (see ``save_state``). The default ("full") and
        "sharded" checkpoints load on any world size and stage; "local" ones need the same world
        size and stage. A folder written by Accelerate for an FSDP model loads too. A bad
        checkpoint raises ``xshard.checkpoint.CheckpointError`` naming the file and key, and
        changes nothing. Accelerate's other keyword arguments are accepted and have no effect.
        """
        from ..checkpoint import load_state, resume

        if directory is None:
            if not project.enabled(self.project_configuration):
                raise ValueError("load_state() needs a folder, or automatic checkpoint naming (ProjectConfiguration("
                                 "automatic_checkpoint_naming=True, project_dir=...))")
            directory = project.latest(self.project_configuration)
        if resume_from_checkpoint:
            return resume(self.job, directory, missing_ok=missing_ok)
        return load_state(self.job, directory, missing_ok=missing_ok)
