"""A third-party anchor's exit cannot fail a test (``support.jobs.run_anchor``): a job that wrote the files the
test reads and then hangs at exit (stock gloo's teardown, pytorch/pytorch#56297) is ended and read, with a
warning; one that fails before writing, or hangs before writing, still fails the test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from support.jobs import run_anchor

# a launcher and its rank, as torchrun starts them: the rank writes its result, then never exits
_WRITES_THEN_HANGS = """
import subprocess, sys
subprocess.run([sys.executable, "-c", "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('done'); "
                "time.sleep(600)", sys.argv[1]])
"""


def test_an_anchor_that_hangs_after_writing_its_files_is_ended_and_read(tmp_path: Path) -> None:
    result = tmp_path / "result.txt"
    started = time.monotonic()
    with pytest.warns(UserWarning, match="wrote its output but had not ended 1s later"):
        done = run_anchor([sys.executable, "-c", _WRITES_THEN_HANGS, str(result)], written=result.is_file,
                          timeout=60, exit_grace=1.0)
    assert done.ok and done.written
    assert result.read_text() == "done" and time.monotonic() - started < 30
    assert "Fatal Python error: Aborted" in done.stderr  # the hung rank's stacks, for the record


def test_an_anchor_that_fails_before_writing_fails_the_test(tmp_path: Path) -> None:
    done = run_anchor([sys.executable, "-c", "raise SystemExit('no data')"], written=(tmp_path / "x").is_file,
                      timeout=60)
    assert not done.ok and done.returncode == 1 and "no data" in done.stderr


def test_an_anchor_that_hangs_before_writing_fails_with_its_stacks(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="did not finish in 3s"):
        run_anchor([sys.executable, "-c", "import time; time.sleep(600)"], written=(tmp_path / "x").is_file,
                   timeout=3)
