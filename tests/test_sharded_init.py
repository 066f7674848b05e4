"""Sharded init: a model built in code inside ``sharded_init()`` gets, once sharded, exactly the weights of
``torch.manual_seed(s); Model()`` and trains as plain PyTorch does; the random numbers drawn after the
block are the ones drawn after a normal init; what cannot be replayed is refused with the reason.
Peak host memory belongs in a benchmark, not in this test.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.models import TinyLM, batch, make_qwen2
from support.sharding_harness import assert_matches, build, case, init_backend, reference, run_cases
from torch import nn

import xshard
from xshard.backends import get_backend
from xshard.sharding import ShardingOptions, shard_model, sharded_init
from xshard.sharding.sharded_init import recording_of


class ManyInits(nn.Module):
    """Initialisation the way real models do it: layer defaults, torch.nn.init functions that skip meta
    tensors or loop on the values they draw (trunc_normal_, orthogonal_), a padding row, a parent
    re-initialising children, values given at creation, weight tying, writes through .data and views,
    a random buffer, and a dedicated generator."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5, padding_idx=2)
        self.lin = nn.Linear(5, 6)
        self.orth = nn.Linear(6, 6, bias=False)
        nn.init.orthogonal_(self.orth.weight)
        self.tn = nn.Parameter(torch.empty(4, 3))
        nn.init.trunc_normal_(self.tn, std=0.02)
        self.ones = nn.Parameter(torch.ones(3))
        self.rnd = nn.Parameter(torch.randn(2, 2) * 0.5)
        self.conv = nn.Conv1d(2, 3, 3)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("proj", torch.randn(3))
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight
        self.gen = nn.Parameter(torch.empty(5))
        nn.init.uniform_(self.gen, generator=torch.Generator().manual_seed(5))
        self.apply(self._init)
        with torch.no_grad():
            self.lin.weight[0].mul_(3.0)
            self.lin.bias.copy_(self.lin.weight[:, 0])

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Conv1d):
            module.weight.data.normal_(0, 0.1)
        elif isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(0.5)


@pytest.mark.parametrize("build", [ManyInits, lambda: TinyLM(tie=False, gated=True), make_qwen2],
                         ids=["many_inits", "tinylm", "qwen2"])
def test_recorded_values_equal_a_normal_init_and_the_generator_moves_alike(build) -> None:
    torch.manual_seed(3)
    plain = build()
    after_plain = torch.rand(4)
    torch.manual_seed(3)
    with sharded_init():
        model = build()
    assert torch.equal(torch.rand(4), after_plain)  # the code after the block draws the same numbers
    recording = recording_of(model)
    plain_params = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        assert p.is_meta, name
        assert torch.equal(recording.materialize(p), plain_params[name].detach()), name
    for (name, b), (_, c) in zip(model.named_buffers(), plain.named_buffers(), strict=True):
        assert torch.equal(b, c), name  # buffers are real, computed by their constructors


def test_what_cannot_be_replayed_is_refused_with_the_reason() -> None:
    class ReadsItsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            if self.lin.weight.abs().max() > 10:  # a value read during construction
                raise AssertionError

    with pytest.raises(RuntimeError, match=r"reads a parameter's value .* Build this model outside sharded_init"):
        with sharded_init():
            ReadsItsWeight()
    with sharded_init():
        model = TinyLM()
    model.to(torch.float64)  # changed after the block: not recorded
    # the root unit's own parameter comes first in unit order
    with pytest.raises(RuntimeError, match=r"'logit_scale' was changed after the sharded_init block"):
        shard_model(model, get_backend("cpu"), ShardingOptions(stage=3))


def test_a_parameter_changed_after_the_block_is_never_rebuilt_from_another_ones_recording() -> None:
    # model.to() swaps each Parameter's storage; a new storage may land at a freed one's address, and
    # the recording must not answer for it with whatever parameter once lived there
    for _ in range(10):
        with sharded_init() as recording:
            model = TinyLM()
        model.to(torch.float64)
        for p in model.parameters():
            with pytest.raises(RuntimeError, match="outside the sharded_init block"):
                recording.materialize(p)


def _si(**kw):
    return case(sharded_init=True, **kw)


# stage 3 and 2 from shards, stage 0 whole; an optimizer built on the meta parameters; a tied LM
CASES = {
    "stage-3": _si(stage=3),
    "stage-2-opt-before": _si(stage=2, opt_before=True),
    "stage-0": _si(stage=0),
    "qwen2-stage-3": _si(stage=3, model="qwen2"),
}


@pytest.mark.multiprocess
def test_sharded_init_gives_a_normal_init_and_trains_like_plain_pytorch() -> None:
    per_rank = run_workers(run_cases, 2, list(CASES.values()))
    for i, (name, c) in enumerate(CASES.items()):
        results = [r[i] for r in per_rank]
        plain = build(c).state_dict()
        initial = results[0]["initial"]
        assert initial.keys() == plain.keys()
        for key, value in plain.items():
            assert torch.equal(initial[key], value), (name, key)  # bit for bit: the same initial weights
        assert_matches(results, reference(c), 1e-5, label=name)


def _unseeded_worker(rank: int, world_size: int) -> dict:
    """Ranks that built from different seeds: sync_module_states gives everyone rank 0's values."""
    backend = init_backend()
    out = {}
    for sync in (True, False):
        torch.manual_seed(100 + rank)
        with sharded_init():
            model = TinyLM()
        sm = shard_model(model, backend, ShardingOptions(stage=3, sync_module_states=sync))
        out[sync] = sm.full_state_dict()
    backend.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_sync_module_states_takes_rank_0s_values_one_parameter_at_a_time() -> None:
    rank0 = run_workers(_unseeded_worker, 2)[0]
    torch.manual_seed(100)
    plain = TinyLM().state_dict()
    for key, value in plain.items():
        assert torch.equal(rank0[True][key], value), key
    # without it each rank keeps its rows of its own model (a mix), as a normal init would give
    assert any(not torch.equal(rank0[False][k], v) for k, v in plain.items())


def test_accelerator_sharded_init_with_an_optimizer_built_before_prepare() -> None:
    acc = xshard.Accelerator(config={"stage": 3}, seed=0)
    with acc.sharded_init():
        model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # on the meta parameters
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(0)
    plain = TinyLM()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(2):
        ids, labels = batch(step, 4)
        for m, o in ((model, opt), (plain, plain_opt)):
            loss = m(ids, labels)
            acc.backward(loss) if m is model else loss.backward()
            o.step()
            o.zero_grad()
    state = model.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    acc.end_training()


def _accelerator_worker(rank: int, world_size: int) -> dict:
    """A script that seeds each rank differently before building under accelerator.sharded_init()."""
    acc = xshard.Accelerator(config={"stage": 3})
    torch.manual_seed(100 + rank)
    with acc.sharded_init():
        model = TinyLM()
    model = acc.prepare(model)
    state = model.state_dict()
    acc.end_training()
    return state


@pytest.mark.multiprocess
def test_accelerator_prepare_gives_every_rank_rank_0s_sharded_init_values() -> None:
    states = run_workers(_accelerator_worker, 2)
    torch.manual_seed(100)
    plain = TinyLM().state_dict()
    for state in states:
        assert state.keys() == plain.keys()
        for key, value in plain.items():
            assert torch.equal(state[key], value), key
