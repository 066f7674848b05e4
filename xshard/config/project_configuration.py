"""Accelerate's ``ProjectConfiguration``: where a run keeps its files.

A configuration object, so it lives with the configuration (``accelerate_args`` builds the default
one); what the Accelerator does with it (automatic checkpoint naming) is ``xshard.accelerate_compat.project``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProjectConfiguration:
    """Where a run keeps its files (Accelerate's ``ProjectConfiguration``).

    Args:
        project_dir: the run's folder; with ``automatic_checkpoint_naming`` checkpoints go to
            ``project_dir/checkpoints/checkpoint_<iteration>``.
        logging_dir: where trackers write (default: ``project_dir``).
        automatic_checkpoint_naming: ``save_state()``/``load_state()`` without a folder use the
            numbered folders above.
        total_limit: keep only the newest N of those checkpoints.
        iteration: the number the next automatic checkpoint gets.
        save_on_each_node: xshard writes once per job on a shared filesystem (warned when True).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when unset."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir
