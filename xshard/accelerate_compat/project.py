"""Accelerate's automatic checkpoint naming: ``project_dir/checkpoints/checkpoint_<iteration>``.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, ``save_state()`` without a folder
writes the next numbered checkpoint and then keeps only the newest ``total_limit`` complete ones
(``xshard.checkpoint.files.rotate``: the one just written is never deleted, and an interrupted save
never counts); ``load_state()`` without a folder loads the newest complete one and continues the
numbering after it, so a resumed run does not collide with its own checkpoints. A job restarted by
``xshard launch --max_restarts`` that resumed one of these checkpoints by itself continues the
numbering the same way (``continue_after``), naming its folders as the uninterrupted run would.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..checkpoint.files import latest_checkpoint
from ..config.project_configuration import ProjectConfiguration

__all__ = ["ProjectConfiguration", "checkpoints_folder", "continue_after", "enabled", "latest", "next_checkpoint"]


_NUMBER = re.compile(r"(\d+)$")


def enabled(project: Any) -> bool:
    """True when ``save_state``/``load_state`` may be called without a folder."""
    return bool(getattr(project, "automatic_checkpoint_naming", False))


def checkpoints_folder(project: Any) -> Path:
    """``project_dir/checkpoints`` (an error naming the fix when there is no project_dir)."""
    root = getattr(project, "project_dir", None)
    if root is None:
        raise ValueError("automatic_checkpoint_naming needs a project_dir: pass project_dir=... to the Accelerator "
                         "or to ProjectConfiguration")
    return Path(root) / "checkpoints"


def next_checkpoint(project: Any) -> Path:
    """The folder the next automatic save writes (an error if it exists, as in Accelerate)."""
    path = checkpoints_folder(project) / f"checkpoint_{project.iteration}"
    if path.exists():
        raise ValueError(f"checkpoint folder {path} already exists: set accelerator.project_configuration.iteration "
                         "to the number the next checkpoint should have")
    return path


def latest(project: Any) -> Path:
    """The newest complete automatic checkpoint; the numbering continues after it."""
    folder = checkpoints_folder(project)
    path = latest_checkpoint(folder)
    if path is None:
        raise ValueError(f"load_state(): no complete checkpoint under {folder} to load")
    continue_after(project, path)
    return path


def continue_after(project: Any, checkpoint: str | os.PathLike) -> None:
    """After ``checkpoint`` was loaded, the next automatic save gets the number after its own
    (``checkpoint_6`` loaded: ``checkpoint_7`` next). Nothing changes for a folder that is not one of
    the project's automatic checkpoints, or when automatic naming is off."""
    path = Path(checkpoint)
    if not enabled(project) or getattr(project, "project_dir", None) is None:
        return
    if path.parent.resolve() != checkpoints_folder(project).resolve():
        return
    number = _NUMBER.search(path.name)
    if number is not None:
        project.iteration = max(int(getattr(project, "iteration", 0)), int(number.group(1)) + 1)
