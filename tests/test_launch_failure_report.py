"""The launcher's last line for a failed job (``backends/launchers/torchrun.failure_report``): the exit code and
the rank it names, from what torchrun recorded of each failed rank (whole-second times, exit codes, the error
file an xshard rank leaves)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from xshard.backends.launchers.torchrun import failure_report


def _failure(exitcode: int, error: str | None = None, timestamp: int = 100, local_rank: int = 0) -> SimpleNamespace:
    data = {"message": {"message": error}} if error is not None else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=timestamp, local_rank=local_rank)


def test_a_rank_that_raised_and_was_stopped_while_ending_fails_the_job_with_its_exception_and_code_1() -> None:
    # rank 1's script raised; rank 0, which learnt of it, exited first, and torchrun's SIGTERM reached rank 1
    # while it was ending (seen in CI: the job said 143, as if a signal had stopped a healthy job)
    code, line = failure_report({
        0: _failure(1, "RankDiedError: rank 1 crashed with ValueError: bad labels"),
        1: _failure(-int(signal.SIGTERM), "ValueError: bad labels", local_rank=1),
    })
    assert code == 1
    assert line.startswith("xshard launch: rank 1 (local rank 1) failed with exit code 1 (ValueError: bad labels); "
                           "rank 0 exited with code 1"), line


def test_a_killed_rank_keeps_its_signal_code_and_a_healthy_rank_stopped_after_it_is_not_the_cause() -> None:
    code, line = failure_report({
        0: _failure(-int(signal.SIGTERM)),  # healthy, stopped by torchrun: no error of its own
        1: _failure(-int(signal.SIGKILL), local_rank=1),
    })
    assert code == 137
    assert line.startswith("xshard launch: rank 1 (local rank 1) failed with exit code 137; rank 0 was stopped"), line


def test_the_earlier_failure_is_named_first_whatever_its_rank() -> None:
    code, line = failure_report({0: _failure(2, "SystemExit: 2", timestamp=105),
                                 3: _failure(1, "RuntimeError: out of memory", timestamp=101, local_rank=1)})
    assert code == 1 and line.startswith("xshard launch: rank 3 (local rank 1) failed with exit code 1 "
                                         "(RuntimeError: out of memory); rank 0 exited with code 2"), line
