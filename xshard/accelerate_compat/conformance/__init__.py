"""Accelerate's public surface, member by member, and what xshard does with each one.

One module per surface (the Accelerator, the prepared optimizer and scheduler, the prepared loader,
``accelerate.utils``' names, the plugin and ``*Kwargs`` constructors) holds a ``ROWS`` table: one ``Row`` per
public member of the installed accelerate. ``tests/test_accelerate_conformance.py`` enumerates the installed
accelerate and fails on a member without a row, so a new Accelerate release shows its new surface as failures,
never as silence; docs/accelerate-scripts.md shows the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["same", "warned", "refused"]


@dataclass(frozen=True)
class Row:
    """What xshard does with one member of Accelerate's surface.

    ``status``: "same" (Accelerate's behaviour), "warned" (accepted; one warning names it and what xshard does
    instead) or "refused" (an error naming xshard's way). ``how``: a few words on what xshard does, or its way.
    ``test``: the test that runs it under Accelerate and xshard and compares them, or shows the warning or error
    (``file.py::test_name``).
    """

    status: Status
    how: str
    test: str
