"""Stage 3 on XLA keeps one unit's gathered parameters alive at a time: each unit's all-gather is
fenced with an optimization barrier, as torch_xla's FSDP fences its own, and the lowered graph (HLO
text on XLA:CPU, where the runtime reports no device memory) shows it: every computation with unit k's
full parameters must run before unit k+1's gather. Without the fences the same check finds every
pair of units live together (each gather depends on its shard alone)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")

from support.xla_replicas import run_replicas  # noqa: E402
from support.xla_unit_liveness import forward_hlo, summary  # noqa: E402

pytestmark = pytest.mark.xla


def test_no_two_units_gathered_parameters_are_live_together_at_stage_3() -> None:
    fenced, unfenced = (summary(run_replicas(forward_hlo, 2, fence, timeout=270)[0]) for fence in (True, False))
    assert fenced["gathers"] == unfenced["gathers"] == 5, (fenced, unfenced)  # the root and 4 blocks
    assert fenced["together"] == [], fenced["together"]
    assert [pair[:2] for pair in unfenced["together"]] == [(1, 2), (2, 3), (3, 4)], unfenced["together"]
