"""``python -m xshard.accelerate_compat.conformance``: the markdown tables of Accelerate's surfaces and what xshard
does with each member (the section "Every member, by enumeration" of docs/accelerate-scripts.md).

``--json`` prints ``{"members": ..., "version": ..., "markdown": ...}`` instead: the installed accelerate's
members by surface too (what ``tests/test_accelerate_conformance.py`` reads, from a process of its own).
``--write PAGE`` puts the tables into PAGE between its markers (``DOC_BEGIN`` / ``DOC_END``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import render, with_tables
from .installed import installed


def main(argv: list[str]) -> int:
    """Print the tables (or, with ``--json``, the members and the tables; with ``--write PAGE``, write them)."""
    members, version = installed()
    markdown = render(members, version)
    if "--write" in argv:
        page = Path(argv[argv.index("--write") + 1])
        page.write_text(with_tables(page.read_text(), markdown))
    elif "--json" in argv:
        print(json.dumps({"members": members, "version": version, "markdown": markdown}))
    else:
        print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
