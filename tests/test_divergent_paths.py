"""Ranks on different paths: at stages 1-3 and hybrid, ranks whose batches take different branches train as
plain PyTorch does on all ranks' batches, and never hang.

The model has what real programs branch over: an image tower that some batches (some ranks, some steps)
have no image for, experts that tokens are routed to by the data (one that only some ranks' tokens reach,
one that no token reaches), and an adapter picked per batch. Every block is a unit of its own. The
reference is one plain process that runs each rank's batch through the same model and averages the losses,
which is what DDP's gradient is: the tests compare every rank's losses, every parameter's gradient norm
at every step (before clipping, so a gradient reduced with a wrong scale or from the wrong unit shows),
the clip norm and the final weights. A parameter no rank used in a step has no gradient in that step, and
one no rank ever uses keeps its initial weights (AdamW's decay never touches it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from support.distributed import run_workers
from support.sharding_harness import assert_each_rank_like, gradient_norms
from torch import nn

pytestmark = pytest.mark.multiprocess

D, STEPS = 8, 3
#: the expert that tokens of every rank go to, one that only rank 0's reach, one that none reaches
SHARED, RANK0_ONLY, NEVER = 0, 1, 2


class Block(nn.Module):
    """One residual block: the unit class."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Branchy(nn.Module):
    """An image tower, text blocks, routed experts and per-batch adapters, each block a unit."""

    _no_split_modules = ["Block"]

    def __init__(self, vision_last: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(6, D)
        self.pixels = nn.Linear(4, D)
        if vision_last:  # registered after the text blocks, run before them (as CLIP's towers)
            self.text = nn.ModuleList([Block(), Block()])
            self.vision = nn.ModuleList([Block(), Block()])
        else:
            self.vision = nn.ModuleList([Block(), Block()])
            self.text = nn.ModuleList([Block(), Block()])
        self.experts = nn.ModuleList([Block() for _ in range(3)])
        self.adapters = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, image: torch.Tensor | None, routes: torch.Tensor, adapter: int) -> torch.Tensor:
        h = self.embed(x)
        if image is not None:
            v = self.pixels(image)
            for block in self.vision:
                v = block(v)
            h = h + v
        for block in self.text:
            h = block(h)
        moe = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):  # as Mixtral's and Qwen2-MoE's loops: an expert without tokens is skipped
            chosen = routes == e
            if chosen.any():
                moe = moe.index_put((chosen.nonzero().squeeze(-1),), expert(h[chosen]), accumulate=True)
        h = self.adapters[adapter](h + moe)
        return self.head(h).squeeze(-1)


def build(vision_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Branchy(vision_last)


def batch(rank: int, world: int, step: int, micro: int, all_images_first: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s batch: images on rank 0 at even steps (and on rank 2 at step 1), none elsewhere, so that
    at step 1 of a 2-rank job no rank runs the tower; tokens routed to SHARED everywhere and to RANK0_ONLY on
    rank 0; the adapter by rank."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    x = torch.randn(4, 6, generator=g)
    images = (rank == 0 and step % 2 == 0) or (rank == 2 and step == 1) or (all_images_first and step == 0)
    image = torch.randn(4, 4, generator=g) if images else None
    routes = torch.tensor([SHARED, RANK0_ONLY, SHARED, RANK0_ONLY] if rank == 0 else [SHARED] * 4)
    return {"x": x, "image": image, "routes": routes, "adapter": rank % 2, "y": torch.randn(4, generator=g)}


def loss_of(model: nn.Module, b: dict[str, Any]) -> torch.Tensor:
    out = model(b["x"], b["image"], b["routes"], b["adapter"])
    return (out - b["y"]).pow(2).mean()


CASE: dict[str, Any] = dict(stage=3, micro=1, clip=1.0, options={}, vision_last=False, all_images_first=False)


def case(**kw: Any) -> dict[str, Any]:
    return {**CASE, **kw}


def reference(c: dict[str, Any], world: int) -> dict[str, Any]:
    """One plain process: each step, every rank's batch through the model, the losses averaged (DDP's gradient)."""
    model = build(c["vision_last"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        for micro in range(c["micro"]):
            per_rank = [loss_of(model, batch(r, world, step, micro, c["all_images_first"])) for r in range(world)]
            (torch.stack(per_rank).mean() / c["micro"]).backward()
            losses.append([loss.item() for loss in per_rank])
        grads.append({n: p.grad.double().norm().item() for n, p in model.named_parameters() if p.grad is not None})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip"]).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train(backend: Any, rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    from xshard.sharding import ShardingOptions, shard_model

    model = build(c["vision_last"])
    sm = shard_model(model, backend, ShardingOptions(stage=c["stage"], auto_wrap_policy="transformer", **c["options"]))
    opt = torch.optim.AdamW(sm.parameters(), lr=0.05, weight_decay=0.1)
    sm.register_optimizer(opt)
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        for micro in range(c["micro"]):
            with contextlib.nullcontext() if micro == c["micro"] - 1 else sm.no_sync():
                loss = loss_of(sm, batch(rank, world, step, micro, c["all_images_first"]))
                (loss / c["micro"]).backward()
            losses.append(loss.item())
        grads.append(gradient_norms(sm))
        norms.append(sm.clip_grad_norm_(c["clip"]).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "norms": norms, "state": sm.full_state_dict(),
            "passed": sm.stats()["gathers"]["passed"]}


def _worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from xshard.backends import get_backend

    backend = get_backend("cpu")
    backend.init_process_group(timeout=60)
    try:
        return [_train(backend, rank, world, c) for c in cases]
    finally:
        backend.destroy_process_group()


def _assert_like_reference(results: list[dict[str, Any]], ref: dict[str, Any], label: str, atol: float = 2e-6) -> None:
    assert_each_rank_like(results, ref, atol, label)
    state = results[0]["state"]
    untouched = build()
    for key in ("experts.2.lin.weight", "experts.2.lin.bias"):  # no token ever reached it: AdamW left it alone
        assert torch.equal(state[key], untouched.state_dict()[key]), f"{label}: {key} moved though no rank used it"


TWO_RANK_CASES = {
    "stage 3": case(),
    "stage 2": case(stage=2),
    "stage 1": case(stage=1),
    "stage 3, accumulation": case(micro=2),
    "stage 3, activation checkpointing": case(options={"activation_checkpointing": True}),
    "stage 3, offload": case(options={"offload_params": True, "offload_optimizer": True}),
    "stage 3, post-backward prefetch, forward prefetch": case(options={"backward_prefetch": "post",
                                                                       "forward_prefetch": True}),
    "stage 3, no prefetch": case(options={"backward_prefetch": "none", "forward_prefetch": False}),
    "stage 3, vision registered last": case(vision_last=True, all_images_first=True),
}

FOUR_RANK_CASES = {
    "stage 3": case(),
    "stage 2, accumulation": case(stage=2, micro=2),
    "hybrid (shards of 2)": case(options={"shard_group_size": 2}),
    "stage 3, reshard to 2 after forward": case(options={"reshard_after_forward": 2}),
}


@pytest.mark.parametrize("world, cases", [(2, TWO_RANK_CASES), (4, FOUR_RANK_CASES)], ids=["2 ranks", "4 ranks"])
def test_ranks_on_different_branches_train_as_plain_pytorch(world: int, cases: dict[str, dict[str, Any]]) -> None:
    results = run_workers(_worker, world, list(cases.values()), timeout=240)
    for i, (label, c) in enumerate(cases.items()):
        per_rank = [results[rank][i] for rank in range(world)]
        _assert_like_reference(per_rank, reference(c, world), f"{world} ranks, {label}")
        assert all(r["passed"] > 0 for r in per_rank[1:]), f"{label}: the ranks after 0 passed no unit"


def _generate_per_unit(rank: int, world: int) -> dict[str, Any]:
    from transformers import T5Config, T5ForConditionalGeneration

    from xshard.backends import get_backend
    from xshard.sharding import ShardingOptions, shard_model

    def t5() -> T5ForConditionalGeneration:
        torch.manual_seed(0)
        config = T5Config(vocab_size=40, d_model=16, d_ff=24, d_kv=8, num_layers=2, num_heads=2,
                          decoder_start_token_id=0, pad_token_id=0, initializer_factor=8.0)
        return T5ForConditionalGeneration(config).eval()

    backend = get_backend("cpu")
    backend.init_process_group(timeout=60)
    ids = torch.randint(2, 40, (1, 7), generator=torch.Generator().manual_seed(10 + rank))
    sm = shard_model(t5(), backend, ShardingOptions(stage=3, generate_gathers_once=False,
                                                    transformer_layer_cls_to_wrap=["T5Block"]))
    sm.reset_stats()
    got = sm.module.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    passed = sm.stats()["gathers"]["passed"]
    backend.destroy_process_group()
    return {"got": got, "expected": t5().generate(ids, max_new_tokens=6, do_sample=False).tolist(), "passed": passed}


def test_generation_step_by_step_passes_no_encoder_unit() -> None:
    # an encoder-decoder's generate() runs the encoder once, outside the model's forward, then decoding steps
    # whose forwards skip the encoder on every rank: those units are not gathered again at each step
    for rank, r in enumerate(run_workers(_generate_per_unit, 2, timeout=240)):
        assert r["got"] == r["expected"], f"rank {rank}"
        assert r["passed"] == 0, f"rank {rank} passed {r['passed']} units while generating"
