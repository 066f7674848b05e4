"""Starting and saving a 2-replica XLA job compiles a bounded number of graphs (XLA:CPU).

Every graph is a compilation on a TPU (tens of seconds for a large model), and on XLA:CPU each one
is a chance for the replicas, which compile separately, to fall apart. A broadcast per parameter at
start (65-67 compilations for the minimal example's model) and a gather per unit at save (31-35)
made both grow with the model; coalesced, they are a few graphs whatever the model's depth. The
counts are torch_xla's, of the whole process: each of the 2 replica threads compiles its own copy
of a graph, so 5 graphs are 10 compilations.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")

from support.xla_graph_counts import start_step_save  # noqa: E402
from support.xla_replicas import run_replicas  # noqa: E402

pytestmark = pytest.mark.xla

WORLD = 2
MAX_GRAPHS = 5  # per phase, each compiled once per replica


def test_start_and_save_compile_at_most_five_graphs_each(tmp_path) -> None:
    counts = run_replicas(start_step_save, WORLD, str(tmp_path / "ckpt"), timeout=270)
    assert counts[0] == counts[1], counts  # both replicas read the same process-wide count
    got = counts[0]
    assert got["world"] == WORLD, got
    assert got["start"] <= MAX_GRAPHS * WORLD, got
    assert got["save"] <= MAX_GRAPHS * WORLD, got
    assert (tmp_path / "ckpt").is_dir()
