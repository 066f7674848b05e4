"""Same numbers as plain PyTorch off the happy path, at every stage, on 2 gloo ranks.

Each case of ``semantics_cases`` (skipped blocks, a block run twice, a weight shared by two blocks, a
forward of one block alone, freezing and unfreezing mid-run, a Transformer, bf16 and fp32 parameters
in one model) is trained sharded at stages 0-3 and by plain PyTorch in one process on the whole
batch, with AdamW and weight decay. They must agree on every step's loss, on which parameters had no
gradient after each backward (``grad is None``, as PyTorch leaves it for a parameter no rank used),
and on the final weights, read through the prepared model's own ``state_dict()`` (whole tensors,
the user's names).
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.semantics_cases import BATCH, CASES, build, reference, train

pytestmark = pytest.mark.multiprocess

STAGES = (0, 1, 2, 3)


def _worker(rank: int, world: int, names: list[str]) -> dict:
    from support.sharding_harness import init_backend

    from xshard.sharding import ShardingOptions, shard_model

    backend = init_backend()
    per = BATCH // world
    out = {}
    for name in names:
        for stage in STAGES:
            sm = shard_model(build(name), backend, ShardingOptions(stage=stage))
            res = train(name, sm, sm.module, lambda t: t[rank * per:(rank + 1) * per])
            res["state"] = sm.state_dict()
            res["shapes"] = {k: tuple(v.shape) for k, v in sm.module.state_dict().items()}
            out[(name, stage)] = res
    backend.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def sharded() -> list[dict]:
    return run_workers(_worker, 2, list(CASES), timeout=270)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_plain_pytorch_at_every_stage(sharded: list[dict], name: str) -> None:
    ref = reference(name)
    atol = CASES[name][2]
    for stage in STAGES:
        runs = [r[(name, stage)] for r in sharded]
        where = f"{name} stage {stage}"
        losses = torch.tensor([r["losses"] for r in runs]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), atol=atol, rtol=0,
                                   msg=lambda m, where=where: f"{where} losses: {m}")
        for r in runs:
            assert r["missing"] == ref["missing"], f"{where}: grad-is-None pattern differs from PyTorch"
            assert set(r["state"]) == set(ref["state"]), f"{where}: state_dict keys differ"
            for key, value in ref["state"].items():
                assert r["shapes"][key] == tuple(value.shape), f"{where} {key}: state_dict shape"
                torch.testing.assert_close(r["state"][key].float(), value.float(), atol=atol, rtol=0,
                                           msg=lambda m, key=key, where=where: f"{where} {key}: {m}")


def test_cases_exercise_what_they_claim() -> None:
    """The reference itself has the situations the cases are about (a check that can fail)."""
    skipped = reference("skipped_blocks")["missing"]
    assert not any(skipped[0]) and all(any(m) for m in skipped[1:])  # some parameter without gradient
    frozen = reference("freeze_and_unfreeze")["missing"]
    assert sum(frozen[1]) > 0 and sum(frozen[2]) > sum(frozen[1]) - 1 and not any(frozen[3])
