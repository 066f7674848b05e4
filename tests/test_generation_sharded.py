"""A sharded model used outside its own forward, against the same model unsharded, at stages 0, 2 and 3
on 2 processes (a tiny random T5: its ``generate()`` calls the encoder alone, as users' code does):

- ``unwrap_model(model).generate(...)`` and TRL's ``unwrap_model_for_generation`` give the unsharded
  model's tokens, also when one rank's sequences end (EOS) many steps before the other's;
- the encoder called alone, and ``get_input_embeddings()(ids)``, give the unsharded model's outputs; an
  embedding computed that way and fed back as ``inputs_embeds`` trains to the unsharded model's weights;
- ``accelerator.summon_full_params(model)`` gives whole parameters for a block of code: a change made in
  it on every rank is kept (``writeback``, the default) or, at stages 1-3, discarded (``writeback=False``).
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

STAGES = (0, 2, 3)
VOCAB = 48


def _t5(initializer_factor: float = 8.0):
    """A tiny random T5. Its large initialisation (8) makes generation choose varied tokens, and makes the model
    chaotic: 1e-7 relative changes of its weights change an SGD step's update by about 1%, so the training check
    uses the standard 1.0, where last-bit differences of the kernels stay last-bit."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=16, d_ff=24, d_kv=8, num_layers=2, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=initializer_factor,
                      dropout_rate=0.0)
    return T5ForConditionalGeneration(config)


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(10 + rank))


def _generate(model, ids: torch.Tensor, eos: int) -> list[list[int]]:
    return model.generate(ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=eos).tolist()


def _stage_run(acc, stage: int, rank: int) -> dict:
    from trl.models import unwrap_model_for_generation

    ids = _ids(rank)
    model = acc.prepare(_t5())
    unwrapped = acc.unwrap_model(model)
    reference = _t5().eval()
    model.eval()
    # rank 0 stops at its second token (taken as EOS), rank 1 runs all 8 steps: the ranks' loops differ in length
    tokens = reference.generate(ids[:1], max_new_tokens=8, do_sample=False).tolist()
    eos = tokens[0][2] if rank == 0 else VOCAB + 5
    out: dict = {"stage": stage, "expected": _generate(reference, ids, eos), "got": _generate(unwrapped, ids, eos)}
    with unwrap_model_for_generation(model, acc) as trl_model:
        out["trl"] = _generate(trl_model, ids, eos)
    with torch.no_grad():
        out["encoder"] = (torch.equal(unwrapped.get_encoder()(input_ids=ids).last_hidden_state,
                                      reference.get_encoder()(input_ids=ids).last_hidden_state))
        out["embeddings"] = torch.equal(unwrapped.get_input_embeddings()(ids), reference.get_input_embeddings()(ids))
    # summon_full_params: a change kept, then one discarded
    norm = "encoder.final_layer_norm.weight"
    with acc.summon_full_params(unwrapped):
        unwrapped.encoder.final_layer_norm.weight.fill_(2.0)
    with acc.summon_full_params(model, writeback=False):
        out["whole_inside"] = tuple(unwrapped.shared.weight.shape) == (VOCAB, 16)
        unwrapped.encoder.final_layer_norm.weight.fill_(3.0)
    # whole tensors on every rank; at stage 0 the parameters are the model's own: changes always stay (as FSDP's NO_SHARD)
    out["kept"] = bool(unwrapped.state_dict()[norm].eq(3.0 if stage == 0 else 2.0).all())
    acc.end()
    return out


def _train_through_embeddings(acc, rank: int) -> dict:
    """One SGD step whose input embeddings were computed off-forward, as ``inputs_embeds``."""
    model = _t5(initializer_factor=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    ids, labels = _ids(rank), _ids(rank + 2)
    embeds = acc.unwrap_model(model).get_input_embeddings()(ids)
    acc.backward(model(inputs_embeds=embeds, labels=labels).loss)
    opt.step()
    weights = acc.get_state_dict(model)
    acc.end()
    return weights


def _worker(rank: int, world: int) -> list[dict]:
    import xshard

    results = [_stage_run(xshard.Accelerator(stage=stage, seed=0), stage, rank) for stage in STAGES]
    results.append({"trained": _train_through_embeddings(xshard.Accelerator(stage=3, seed=0), rank)})
    return results


def test_generate_encoder_embeddings_and_summon_off_forward_equal_the_unsharded_model() -> None:
    results = run_workers(_worker, 2, timeout=240)
    for rank, per_rank in enumerate(results):
        for r in per_rank[:-1]:
            where = f"stage {r['stage']}, rank {rank}"
            assert r["got"] == r["expected"], where
            assert r["trl"] == r["expected"], where
            assert r["encoder"] and r["embeddings"], where
            assert r["whole_inside"], where
            assert r["kept"], where
    # the tokens are no trivial sequence, and rank 0 stopped early where rank 1 did not
    assert len(results[0][0]["expected"][0]) <= 3 and len(results[1][0]["expected"][0]) == 9
    assert len(set(results[1][0]["expected"][0])) > 2
    # the reference step: the same loss averaged over both ranks' batches, on one unsharded model
    model = _t5(initializer_factor=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = [model(inputs_embeds=model.get_input_embeddings()(_ids(r)), labels=_ids(r + 2)).loss for r in (0, 1)]
    (sum(losses) / 2).backward()
    opt.step()
    trained = results[0][-1]["trained"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(trained[key], value, atol=1e-5, rtol=1e-5, msg=key)
