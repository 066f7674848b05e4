"""Two nodes (network namespaces joined by a veth pair, tests/support/netns.py), one rank each, started with
``xshard launch --nnodes 2``; the link between them is cut while they train.

Cut for good: each node's rank stops within the timeout and says the other node is unreachable, with how
it knows (node 0 holds the store and sees rank 1's heartbeat stop while no connection closed; node 1 gets
no answer from the store), and both launchers exit. Neither waits on the store it cannot reach. Cut for
less than the timeout: training goes on and ends. Cut for good under ``--max_restarts``: node 1's launcher,
whose restart would wait on node 0's store, exits naming node 0 unreachable once its connection went
unacknowledged for ``--join_timeout`` seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.netns import TwoNodes, two_nodes

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parent / "support" / "lost_node_train.py"
TIMEOUT = 15  # the job's (Accelerator(timeout=...))


class _Job:
    """Both nodes' launchers, their output in files."""

    def __init__(self, nodes: TwoNodes, out: Path, steps: int, options: tuple[str, ...] = ()) -> None:
        self.out = out
        out.mkdir()
        env = {**os.environ, "XSHARD_BACKEND": "cpu", "PYTHONFAULTHANDLER": "1"}
        self.procs = []
        for node in (0, 1):
            argv = [sys.executable, "-m", "xshard", "launch", "--nnodes", "2", "--node_rank", str(node),
                    "--master_addr", nodes.address(0), "--master_port", "29517", "--nproc", "1",
                    *options, str(SCRIPT), str(out), str(steps), str(TIMEOUT)]
            with open(out / f"node{node}.log", "w") as log:
                self.procs.append(subprocess.Popen(nodes.command(node, argv), env=env, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))

    def step(self, rank: int) -> int:
        try:
            return int((self.out / f"step.rank{rank}").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait_for_step(self, step: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while min(self.step(0), self.step(1)) < step:
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs), \
                f"the job did not reach step {step}:\n{self.output(0)[-2000:]}\n{self.output(1)[-2000:]}"
            time.sleep(0.1)

    def wait_for_exits(self, seconds: float) -> list[float]:
        """Seconds until each node's launcher exited (the test fails if one is still running after ``seconds``)."""
        start, ended = time.monotonic(), [0.0, 0.0]
        while not all(ended) and time.monotonic() - start < seconds:
            for node, p in enumerate(self.procs):
                if not ended[node] and p.poll() is not None:
                    ended[node] = time.monotonic() - start
            time.sleep(0.1)
        assert all(ended), (f"node(s) {[n for n in (0, 1) if not ended[n]]} still running {seconds:.0f} s on:\n"
                            f"{self.output(0)[-2000:]}\n---\n{self.output(1)[-2000:]}")
        return ended

    def output(self, node: int) -> str:
        return (self.out / f"node{node}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


#: the line `xshard launch` adds after a failure's cause when ranks wrote their flight records
FLIGHT_POINTER = "xshard launch: the last collectives of "


def _error(output: str) -> str:
    """The error a rank ended with, as its traceback's last line shows it."""
    lines = [line for line in output.splitlines() if "xshard.errors." in line]
    assert lines, f"no xshard error in:\n{output[-3000:]}"
    return lines[-1]


def test_a_node_cut_off_for_good_is_named_unreachable_on_both_sides_within_the_timeout(tmp_path):
    with two_nodes() as nodes:
        job = _Job(nodes, tmp_path / "out", steps=100000)
        try:
            job.wait_for_step(15, 120)
            nodes.cut()
            seconds = job.wait_for_exits(TIMEOUT + 25)
        finally:
            job.stop()
    assert [p.returncode for p in job.procs] == [1, 1], (job.output(0)[-2000:], job.output(1)[-2000:])
    node0, node1 = _error(job.output(0)), _error(job.output(1))
    assert "RankDiedError: rank 1 is unreachable (process " in node0 and "on xnode1: no heartbeat for" in node0, node0
    assert "and no connection closed" in node0, node0
    assert "RankDiedError: the node that holds the job's key-value store" in node1, node1
    # "rank 0 on xnode0" once rank 1 read rank 0's entry (its first beats); "rank 0" from torchrun's variables before
    assert "is unreachable from this host (xnode1)" in node1 and "unreachable with it: rank 0" in node1, node1
    for message in (node0, node1):
        assert "never arrived" not in message and "deadlock" not in message and " died " not in message, message
    assert max(seconds) < TIMEOUT + 20, seconds  # the timeout, the explanation (bounded) and the exits


def test_a_cut_shorter_than_the_timeout_does_not_stop_the_training(tmp_path):
    with two_nodes() as nodes:
        job = _Job(nodes, tmp_path / "out", steps=60)
        try:
            job.wait_for_step(5, 120)
            nodes.cut()
            time.sleep(4)
            nodes.mend()
            job.wait_for_exits(90)
        finally:
            job.stop()
    assert [p.returncode for p in job.procs] == [0, 0], (job.output(0)[-3000:], job.output(1)[-3000:])
    assert job.step(0) == job.step(1) == 60 and (tmp_path / "out" / "final.pt").exists()


def test_under_max_restarts_a_node_cut_off_for_good_ends_both_launchers_naming_the_lost_node(tmp_path):
    with two_nodes() as nodes:
        job = _Job(nodes, tmp_path / "out", steps=100000, options=("--max_restarts", "1", "--join_timeout", "15"))
        try:
            job.wait_for_step(5, 120)
            nodes.cut()
            job.wait_for_exits(TIMEOUT + 15 + 40)
        finally:
            job.stop()
    assert [p.returncode for p in job.procs] == [1, 1], (job.output(0)[-2000:], job.output(1)[-2000:])
    assert "RankDiedError: rank 1 is unreachable (process " in job.output(0)
    # the launcher's last word names the cause; only the pointer to the ranks' flight records may follow it
    lines = [line for line in job.output(1).strip().splitlines() if not line.startswith(FLIGHT_POINTER)]
    last = lines[-1]
    assert last.startswith("xshard launch: node 0 (the job's store at ") and "is unreachable from this node" in last
    assert "with no acknowledgement for 15 s" in last, last
