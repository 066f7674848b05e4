"""What a checkpoint format is: the protocols ``format_registry`` holds and ``save_load`` asks.

- ``ReadingFormat``: plans a load from a folder (``read``, returning a ``LoadPlan``; changes nothing);
- ``CheckpointFormat``: a reading format ``save_state`` also writes, selected by its ``name`` (the
  ``state_dict_type``, recorded in the manifest, which names it again at load);
- ``ForeignFormat``: a reading format for folders another tool wrote (no xshard manifest), found by
  asking it whether it ``recognises`` the folder.

A format writes through a ``writer.Writer`` and returns this rank's row tables (``formats.py``); the same
``write`` given a ``writer.SizeWriter`` gives the files and bytes a save would write (``planned_files``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .load_plan import LoadPlan
from .writer import Writer

if TYPE_CHECKING:
    from ..runtime.job import JobState


class ReadingFormat(Protocol):
    """A layout of checkpoint files that a job loads from."""

    @property
    def name(self) -> str:
        """The format's name (a writing format's is its ``state_dict_type``)."""
        ...

    def read(self, job: JobState, folder: Path, on_bytes: Callable[[int], None] | None = None) -> LoadPlan:
        """Everything this rank needs from ``folder``, read and checked against the job; changes nothing.
        ``on_bytes`` (a progress bar's ``update``) hears of the bytes read, where the format counts them."""
        ...


class CheckpointFormat(ReadingFormat, Protocol):
    """A format ``save_state`` writes (every rank calls ``write``; collectives inside run on all ranks)."""

    def write(self, job: JobState, writer: Writer) -> dict[str, Any]:
        """Write this rank's files through ``writer``; returns this rank's row tables (name -> table), which
        the manifest merges over the ranks (``formats.merge_tables``)."""
        ...


class ForeignFormat(ReadingFormat, Protocol):
    """A format of folders without xshard's manifest (another tool wrote them)."""

    def recognises(self, folder: Path) -> bool:
        """Whether ``folder`` is one of this format's folders."""
        ...
