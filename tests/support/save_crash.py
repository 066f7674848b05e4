"""A process that dies in the middle of writing a checkpoint, as a killed writer would.

``die_after_files(n, rank=None)`` makes this process exit abruptly (``os._exit(EXIT_CODE)``, no cleanup) once
its ``FileWriter`` has written ``n`` files of a checkpoint, leaving half a file beside them as a killed writer
leaves it; with ``rank`` only that rank dies. Used by the crash-safety tests of saving (synchronous and
asynchronous), so that xshard itself carries no test hook.
"""

from __future__ import annotations

import os
from typing import Any

#: the exit status of a process that ``die_after_files`` ended
EXIT_CODE = 17


def die_after_files(n: int, rank: int | None = None) -> None:
    """From now on, a checkpoint writer of this process (of ``rank`` only, if given) exits after its ``n``-th file."""
    from xshard.checkpoint.files import FileWriter

    write = FileWriter._write

    def write_then_die(self: FileWriter, name: str, *args: Any, **kwargs: Any) -> None:
        write(self, name, *args, **kwargs)
        if (rank is None or self.rank == rank) and len(self.files) >= n:
            (self.folder / f"partial.rank{self.rank}.safetensors").write_bytes(b"\0" * 16)
            os._exit(EXIT_CODE)

    FileWriter._write = write_then_die  # type: ignore[method-assign]
