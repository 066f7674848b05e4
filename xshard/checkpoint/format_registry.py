"""Which checkpoint format writes a ``state_dict_type``, and which reads a folder.

Writing formats (``format_protocol.CheckpointFormat``) are found by name: ``save_state``'s
``state_dict_type``, which the manifest records and a load reads back. Foreign formats
(``format_protocol.ForeignFormat``) read folders without xshard's manifest: each is asked, in the order
registered, whether it ``recognises`` the folder.

Adding a format is one file and one line: write a module in ``xshard/checkpoint/`` with an object that
has the protocol's members (``name``, ``write`` and ``read`` for a format xshard saves; ``name``,
``recognises`` and ``read`` for another tool's folders), then register it below with ``register(...)`` or
``register_foreign(...)``. ``save_load`` needs no change: it asks this registry. (A test or a plugin may
``register`` at run time and ``unregister`` afterwards.)
"""

from __future__ import annotations

from pathlib import Path

from .files import MANIFEST, CheckpointError, read_manifest
from .foreign import ACCELERATE_FOLDER
from .format_protocol import CheckpointFormat, ForeignFormat, ReadingFormat
from .own_formats import FULL, LOCAL, SHARDED
from .trainer_folder import TRAINER_FOLDER

_writing: dict[str, CheckpointFormat] = {}
_foreign: list[ForeignFormat] = []


def register(fmt: CheckpointFormat) -> None:
    """Make ``fmt`` the format of ``state_dict_type=fmt.name`` (for saving, and loading what it saved)."""
    if fmt.name in _writing:
        raise ValueError(f"a checkpoint format named {fmt.name!r} is registered already")
    _writing[fmt.name] = fmt


def register_foreign(fmt: ForeignFormat) -> None:
    """Read the folders ``fmt`` recognises (asked after the formats registered before it)."""
    _foreign.append(fmt)


def unregister(name: str) -> None:
    """Forget the format named ``name`` (writing or foreign)."""
    _writing.pop(name, None)
    _foreign[:] = [fmt for fmt in _foreign if fmt.name != name]


def state_dict_types() -> tuple[str, ...]:
    """The names ``save_state`` accepts as ``state_dict_type``."""
    return tuple(_writing)


def writing_format(name: str) -> CheckpointFormat:
    """The format that saves ``state_dict_type=name``; a ValueError naming the accepted ones otherwise."""
    fmt = _writing.get(name)
    if fmt is None:
        raise ValueError(f"state_dict_type={name!r}: use one of {', '.join(_writing)}")
    return fmt


def foreign_format(folder: Path) -> ForeignFormat | None:
    """The first foreign format that recognises ``folder`` (None: none does)."""
    return next((fmt for fmt in _foreign if fmt.recognises(folder)), None)


def reading_format(folder: Path) -> ReadingFormat:
    """The format to read ``folder`` with: a foreign one where there is no manifest and one recognises the
    folder, else the one the manifest names (a CheckpointError when the manifest is missing or bad, or
    names no registered format)."""
    if not (folder / MANIFEST).is_file():
        fmt = foreign_format(folder)
        if fmt is not None:
            return fmt
    kind = read_manifest(folder).get("state_dict_type")
    if not isinstance(kind, str) or kind not in _writing:
        raise CheckpointError(f"{folder / MANIFEST}: key 'state_dict_type' is {kind!r}, expected one of "
                              f"{', '.join(_writing)}")
    return _writing[kind]


register(FULL)
register(LOCAL)
register(SHARDED)
register_foreign(ACCELERATE_FOLDER)
register_foreign(TRAINER_FOLDER)
