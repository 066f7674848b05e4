"""The documentation's code is the code's: README.md and docs/*.md cannot drift from what xshard accepts.

- Every fenced ```python block compiles. A block right after the line ``<!-- doc-test: run -->`` is
  self-contained and cheap: it runs, as a script of its own in a fresh process on the cpu backend (one
  process), and must exit 0.
- Every ``xshard <command> ...`` in a ```bash block (after environment variables, ``srun``, ``python -m``)
  parses with the CLI's own argparse parser, ``xshard.cli.build_parser`` (nothing runs); every
  ``make <target>`` names a target of the Makefile; the command CI runs (``.ci/run``) is the README's.
- Every relative link points to an existing file, and a ``#anchor`` into a Markdown file to one of its
  headings (GitHub's heading ids).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.jobs import run_job

from xshard.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARK = "<!-- doc-test: run -->"
#: seconds a runnable block may take (they run side by side; each imports torch and xshard)
RUN_TIMEOUT_S = 150


@dataclass
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    run: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of ``path``, each marked to run when RUN_MARK is the line before its fence."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(```+)\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: a code block that is never closed"
        run = i > 0 and lines[i - 1].strip() == RUN_MARK
        found.append(Block(path, i + 1, fence.group(2).lower(), "\n".join(lines[i + 1:end]) + "\n", run))
        i = end + 1
    return found


ALL_BLOCKS = [b for path in DOCS for b in blocks(path)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]
BASH = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "console")]


def test_the_docs_have_the_pages_and_blocks_this_test_reads() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "accelerate-scripts.md", "trainer-scripts.md", "data-loading.md", "checkpoints.md",
            "launching-and-clusters.md", "sharded-core.md", "backends.md", "architecture.md",
            "troubleshooting.md"} <= names
    assert any(b.run and b.path.name == "README.md" for b in PYTHON), "the README's training loop is not run"
    assert any("xshard launch" in b.source for b in BASH)


def test_every_run_mark_is_on_a_python_block() -> None:
    """A mark that is not right before a ```python fence would silently run nothing."""
    misplaced = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.strip() == RUN_MARK and (n + 1 >= len(lines) or not re.match(r"^```python\s*$", lines[n + 1])):
                misplaced.append(f"{path.relative_to(ROOT)}:{n + 1}")
    assert not misplaced, f"{RUN_MARK} must be the line right before a ```python fence: {misplaced}"


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.source, block.where, "exec")


def test_the_blocks_marked_to_run_run_on_one_cpu_process(tmp_path: Path) -> None:
    runnable = [b for b in PYTHON if b.run]
    env = {**os.environ, "XSHARD_BACKEND": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)

    def run(block: Block) -> str | None:
        folder = tmp_path / re.sub(r"\W", "_", block.where)
        folder.mkdir()
        script = folder / "block.py"
        script.write_text(f"# {block.where}\n{block.source}")
        done = run_job([sys.executable, str(script)], timeout=RUN_TIMEOUT_S, env=env, cwd=folder)
        if done.returncode == 0:
            return None
        return f"{block.where} exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"

    with ThreadPoolExecutor(max_workers=len(runnable)) as pool:
        failures = [f for f in pool.map(run, runnable) if f is not None]
    assert not failures, "\n\n".join(failures)


def shell_commands(source: str) -> list[tuple[str, list[str]]]:
    """(the line, its words) for each simple command of a shell block, split at pipes, redirections and ``;``."""
    found: list[tuple[str, list[str]]] = []
    for line in source.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in lexer:
            if set(token) <= set("();<>|&"):
                found.append((line, words))
                words = []
            else:
                words.append(token)
        found.append((line, words))
    return [(line, words) for line, words in found if words]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for m in re.finditer(r"^([\w.\-/ $()]+?)\s*:(?!=)", text, re.M) for t in m.group(1).split()}


def check_command(words: list[str]) -> str | None:
    """Why this command of the docs would not be accepted, or None."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]  # VAR=value before the command
    if words and words[0] == "make":
        missing = [w for w in words[1:] if not w.startswith("-") and "=" not in w and w not in makefile_targets()]
        return f"no Makefile target {missing}" if missing else None
    at = next((i for i, w in enumerate(words) if w == "xshard" or w.endswith("/xshard")), None)
    if at is None:
        return None  # torchrun, srun python ..., pip ...: not xshard's
    argv = words[at + 1:]
    if not argv or argv[0] not in COMMANDS:
        return f"`xshard` needs one of its commands {sorted(COMMANDS)}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


def test_every_xshard_and_make_command_of_a_bash_block_is_accepted() -> None:
    wrong = []
    for block in BASH:
        for line, words in shell_commands(block.source):
            why = check_command(words)
            if why:
                wrong.append(f"{block.where}: {line.strip()!r}: {why}")
    assert not wrong, "commands the docs show that xshard or make would refuse:\n" + "\n".join(wrong)


def test_the_readme_has_the_command_ci_runs() -> None:
    readme = "".join(b.source for b in BASH if b.path.name == "README.md")
    ci = [words for _, words in shell_commands((ROOT / ".ci" / "run").read_text()) if words[0] == "make"]
    assert ci, ".ci/run runs no make command"
    for words in ci:
        assert re.search(rf"^{re.escape(' '.join(words))}(\s|$)", readme, re.M), (
            f"`{' '.join(words)}` (.ci/run) is not a command of the README's set-up block")


def heading_ids(path: Path) -> set[str]:
    """GitHub's ids of the headings of a Markdown file (lower case, punctuation dropped, spaces as -)."""
    ids: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            ids.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return ids


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of each Markdown link outside code blocks and code spans."""
    found: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            prose = re.sub(r"`[^`]*`", "", line)
            found += [(n, m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", prose)]
    return found


def test_every_relative_link_points_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for path in DOCS:
        for n, target in links(path):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
                broken.append(f"{path.relative_to(ROOT)}:{n}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)
