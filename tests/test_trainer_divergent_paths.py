"""Ranks on different paths with real transformers models: units that one rank's batch runs and another's skips.

LLaVA through the Trainer (``support/trainer_branchy_script.py``): a data set of image samples and text-only
samples, read in order, so that at step 0 only rank 0's batch has images, at step 1 only rank 1's (one image
beside a text sample), at step 2 no rank's and at step 3 both; the collator gives an all-text batch no
``pixel_values``, and LLaVA then skips its vision tower (CLIP's embeddings and 2 encoder layers, a unit each,
with the 2 Llama decoder layers: 6 units). xshard at stage 3 (``deepspeed=`` a ZeRO-3 ds_config) on 2 processes
under ``xshard launch`` against the stock Trainer on Accelerate's DDP with ``ddp_find_unused_parameters=True``
under torchrun: per-step losses and gradient norms, and each side's batches (which samples, how many images) as
meant. Measured on the 2-core CPU machine: losses equal, gradient norms within 1.6e-7 relative; on the engine
before ranks on different paths passed the units they skip (commit 9458852), rank 1 aborts in the first step on
a gloo size mismatch ("Is there a distributed collective mismatch in your code?"). 23-33 s, the two jobs side
by side.

Switch Transformers (the transformers MoE whose experts are modules of their own, ``SwitchTransformersDenseActDense``
in a ModuleDict, run only for the experts that got tokens: transformers 5 fuses the experts of Mixtral, Qwen2-MoE
and Qwen3-MoE into one module of 3D parameters, which every rank runs whatever the routing), top-1 over 8 experts
with 12 encoder and 4 decoder tokens per rank, so that most steps have experts that one rank's tokens reach and
the other's do not, and experts no token reaches. Every expert, dense MLP and attention is a unit
(``transformer_layer_cls_to_wrap``); ``shard_model`` at stage 3 + AdamW, 3 steps on 2 processes, against one
plain process that runs both ranks' batches and averages their losses (the router's z and balancing losses
included): every rank's losses, every parameter's gradient norm at every step before clipping (a parameter no rank
used has none), the clip norm, the final weights, and an expert no token ever reached keeps its initial weights.
The routing is counted in both runs (hooks on the experts) and asserted to have such experts: with this seed
14 (step, expert) pairs reached by one rank's tokens only, 22 reached by none, and 4 experts never reached.
Measured: losses within 4.8e-7 absolute (1e-7 relative), gradient norms within 1.5e-6 relative, weights within
1.7e-6; on the engine of commit 9458852 the job fails with the same gloo size mismatch. About 14 s.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_workers
from support.jobs import run_anchor, run_job
from support.sharding_harness import assert_each_rank_like, gradient_norms
from support.side_by_side import side_by_side
from support.trainer_branchy_script import PATTERN, PER_DEVICE, STEPS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "support" / "trainer_branchy_script.py"
XSHARD_2 = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TIMEOUT = 240  # 23-33 s for the two jobs side by side on an idle 2-core machine
#: relative tolerance of the losses and gradient norms (the model zoo's; measured: at most 1.6e-7)
REL = 1e-4


# ---------------------------------------------------------------------------------------------- LLaVA, Trainer
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1",
               HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def _written(out: Path) -> bool:
    return all((out / name).exists() for name in ("figures.json", "batches-0.json", "batches-1.json"))


def _read(out: Path) -> dict[str, Any]:
    return {"figures": json.loads((out / "figures.json").read_text()),
            "batches": [json.loads((out / f"batches-{rank}.json").read_text()) for rank in range(2)]}


def _stock(out: Path) -> dict[str, Any]:
    done = run_anchor([*TORCHRUN_2, str(SCRIPT), str(out)], timeout=TIMEOUT, cwd=ROOT,
                      env=_env(SFT_TRAINER="stock", ACCELERATE_USE_CPU="true"), written=lambda: _written(out))
    assert done.ok, done.stdout[-3000:] + done.stderr[-5000:]
    return _read(out)


def _xshard(out: Path) -> dict[str, Any]:
    done = run_job([*XSHARD_2, str(SCRIPT), str(out)], timeout=TIMEOUT, cwd=ROOT,
                   env=_env(SFT_TRAINER="xshard", XSHARD_BACKEND="cpu"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {**_read(out), "log": done.stderr}


@pytest.fixture(scope="module")
def llava_runs(tmp_path_factory) -> tuple[dict[str, Any], dict[str, Any]]:
    out = tmp_path_factory.mktemp("branchy")
    stock, ours = side_by_side(lambda: _stock(out / "stock"), lambda: _xshard(out / "xshard"))
    return stock, ours


def test_llava_with_images_on_some_ranks_only_trains_at_stage_3_as_ddp(llava_runs) -> None:
    stock, ours = llava_runs
    log = ours["log"]
    assert any("LlavaForConditionalGeneration: 6 unit(s); stage 3: parameters sharded over all 2 rank(s)" in line
               for line in log.splitlines()), log[-3000:]
    # each side's batches were the ones meant: per step and rank, these samples, this many images
    want = [[{"indices": list(range((2 * step + rank) * PER_DEVICE, (2 * step + rank + 1) * PER_DEVICE)),
              "images": sum(PATTERN[step][rank])} for step in range(STEPS)] for rank in range(2)]
    assert stock["batches"] == want and ours["batches"] == want
    images = [[want[rank][step]["images"] for rank in range(2)] for step in range(STEPS)]
    assert images[0] == [2, 0] and images[1] == [0, 1] and images[2] == [0, 0] and min(images[3]) > 0
    theirs, mine = stock["figures"], ours["figures"]
    assert len(mine["losses"]) == len(theirs["losses"]) == STEPS
    assert mine["losses"] == pytest.approx(theirs["losses"], rel=REL)
    assert mine["grad_norms"] == pytest.approx(theirs["grad_norms"], rel=REL)


# ---------------------------------------------------------------------------------------------- Switch MoE
MOE_STEPS, EXPERTS = 3, 8
ENC, DEC = 6, 2  # tokens per sequence; 2 sequences per rank
#: the unit classes: every expert (and the dense MLPs, the same class) and every attention a unit of its own
UNIT_CLASSES = ["SwitchTransformersDenseActDense", "SwitchTransformersAttention"]


def build_switch() -> torch.nn.Module:
    import transformers as tf

    config = tf.SwitchTransformersConfig(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_heads=2, num_layers=2,
                                         num_sparse_encoder_layers=1, num_decoder_layers=2,
                                         num_sparse_decoder_layers=1, num_experts=EXPERTS, expert_capacity=64,
                                         router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0)
    torch.manual_seed(0)
    return tf.SwitchTransformersForConditionalGeneration(config)


def moe_batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank + 5)
    return {"input_ids": torch.randint(2, 64, (2, ENC), generator=g), "labels": torch.randint(2, 64, (2, DEC), generator=g)}


def _is_expert(name: str) -> bool:
    """``encoder.block.1.layer.1.mlp.experts.expert_3``, not its linears."""
    return name.rsplit(".", 2)[-2:-1] == ["experts"]


def _count_tokens(model: torch.nn.Module) -> dict[str, int]:
    """Tokens each expert got, by expert name, counted by hooks on the experts until the dict is cleared."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if _is_expert(name):
            def hook(_module: Any, inputs: tuple, name: str = name) -> None:
                counts[name] = counts.get(name, 0) + inputs[0].shape[0]
            module.register_forward_pre_hook(hook)
    return counts


def moe_loss(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**b, output_router_logits=True).loss


def moe_reference() -> dict[str, Any]:
    """One plain process: each step both ranks' batches, the losses averaged (DDP's gradient)."""
    model = build_switch()
    counts = _count_tokens(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    losses, grads, norms, routed = [], [], [], []
    for step in range(MOE_STEPS):
        per_rank, step_routes = [], []
        for rank in range(2):
            counts.clear()
            per_rank.append(moe_loss(model, moe_batch(rank, step)))
            step_routes.append(dict(counts))
        torch.stack(per_rank).mean().backward()
        losses.append([loss.item() for loss in per_rank])
        routed.append(step_routes)
        grads.append({n: p.grad.double().norm().item() for n, p in model.named_parameters() if p.grad is not None})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "norms": norms, "routed": routed,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _moe_worker(rank: int, world: int) -> dict[str, Any]:
    from xshard.backends import get_backend
    from xshard.sharding import ShardingOptions, shard_model

    backend = get_backend("cpu")
    backend.init_process_group(timeout=60)
    try:
        model = build_switch()
        counts = _count_tokens(model)
        sm = shard_model(model, backend, ShardingOptions(stage=3, auto_wrap_policy="transformer",
                                                         transformer_layer_cls_to_wrap=UNIT_CLASSES))
        opt = torch.optim.AdamW(sm.parameters(), lr=0.02, weight_decay=0.1)
        sm.register_optimizer(opt)
        losses, grads, norms, routed = [], [], [], []
        for step in range(MOE_STEPS):
            counts.clear()
            loss = moe_loss(sm, moe_batch(rank, step))
            loss.backward()
            losses.append(loss.item())
            routed.append(dict(counts))
            grads.append(gradient_norms(sm))
            norms.append(sm.clip_grad_norm_(1.0).item())
            opt.step()
            opt.zero_grad()
        return {"losses": losses, "grads": grads, "norms": norms, "routed": routed, "units": len(sm.units),
                "state": sm.full_state_dict(), "passed": sm.stats()["gathers"]["passed"]}
    finally:
        backend.destroy_process_group()


def _experts(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if _is_expert(name)]


def test_switch_experts_without_tokens_on_a_rank_train_at_stage_3_as_plain_pytorch() -> None:
    results = run_workers(_moe_worker, 2, timeout=200)
    ref = moe_reference()
    experts = _experts(build_switch())
    # the root, 16 experts, 2 dense MLPs, 6 attentions (2 in the encoder, self and cross in the decoder)
    assert all(r["units"] == 1 + 2 * EXPERTS + 2 + 6 for r in results), [r["units"] for r in results]
    # the routing: each rank's experts as the reference's, and the cases this test is about really happen
    one_rank_only = no_rank = 0
    for step in range(MOE_STEPS):
        for rank in range(2):
            assert results[rank]["routed"][step] == ref["routed"][step][rank], f"step {step}, rank {rank}: routing"
        for expert in experts:
            got = [expert in ref["routed"][step][rank] for rank in range(2)]
            one_rank_only += got[0] != got[1]
            no_rank += not any(got)
    assert one_rank_only >= 10 and no_rank >= 10, (one_rank_only, no_rank)  # measured: 14 and 22
    assert all(r["passed"] > 0 for r in results), "no rank passed a unit: the ranks ran the same experts"
    never = [e for e in experts if not any(e in ref["routed"][s][r] for s in range(MOE_STEPS) for r in range(2))]
    assert never, "every expert got a token at some step: nothing checks an expert untouched by AdamW"
    # every rank's losses, each parameter's gradient norm per step, the clip norms, the final weights (AdamW's
    # steps of tiny gradients: measured within 1.7e-6)
    assert_each_rank_like(results, ref, atol=2e-6, state_atol=1e-5)
    state, untouched = results[0]["state"], build_switch().state_dict()
    for expert in never:
        for key in (f"{expert}.wi.weight", f"{expert}.wo.weight"):
            assert torch.equal(state[key], untouched[key]), f"{key} moved though no token ever reached it"
