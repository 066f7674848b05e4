"""``generate()`` at stage 3 on 2 processes gathers the whole model once for the call when it fits (the fast
path, TRL's ``ds3_gather_for_generation``), or every unit at every decoding step (``synced_gpus``):

- both paths, forced with ``generate_gathers_once`` (and ``auto``, which on this host fits), give the
  unsharded model's tokens, greedy and sampled with a seed, also when one rank's sequences end (EOS) early;
- the fast path issues one all-gather per unit for the whole call, the per-unit path one per unit per step;
- TRL's ``unwrap_model_for_generation`` on a Trainer through ``xshard.trainer.TrainerMixin`` takes the fast
  path, with xshard's own config and with a ZeRO-3 ds_config; its ``ds3_gather_for_generation=False`` the per-unit one.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

VOCAB = 40
NEW_TOKENS = 6
SETTINGS = (True, False, "auto")


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
                         initializer_range=0.5)
    return Qwen2ForCausalLM(config).eval()


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(10 + rank))


def _tokens(model, ids: torch.Tensor, eos: int | None) -> dict[str, list[list[int]]]:
    """Greedy and seeded sampling (the generator's seed is the rank's, as a GRPO step's completions)."""
    greedy = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos).tolist()
    torch.manual_seed(100)
    sampled = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0, eos_token_id=eos).tolist()
    return {"greedy": greedy, "sampled": sampled}


def _setting_run(setting, rank: int) -> dict:
    import xshard

    acc = xshard.Accelerator(stage=3, seed=0, generate_gathers_once=setting)
    model = acc.prepare(_qwen2())
    model.eval()
    unwrapped = acc.unwrap_model(model)
    reference = _qwen2()
    ids = _ids(rank)
    # rank 0 stops at its second new token (taken as EOS), rank 1 runs every step: the loops differ in length
    first = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
    eos = first[0][ids.shape[1] + 1] if rank == 0 else None
    out: dict = {"setting": setting, "expected": _tokens(reference, ids, eos)}
    model.reset_stats()
    out["got"] = _tokens(unwrapped, ids, eos)
    out["path"] = unwrapped.generate.last_path
    out["units"] = model.stats()["units"]
    # one greedy call of NEW_TOKENS steps on rank 1's prompt length (eos never met): its all-gathers alone
    model.reset_stats()
    unwrapped.generate(_ids(1), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    out["all_gathers"] = model.stats()["comm"]["calls"].get("all_gather", 0)
    acc.end()
    return out


def _worker(rank: int, world: int) -> list[dict]:
    return [_setting_run(setting, rank) for setting in SETTINGS]


def test_generate_at_stage_3_gathers_once_and_equals_the_unsharded_model_on_both_paths() -> None:
    results = run_workers(_worker, 2, timeout=240)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            where = f"generate_gathers_once={r['setting']!r}, rank {rank}: {r['all_gathers']} all-gathers"
            assert r["got"] == r["expected"], where
            assert r["path"] == ("per_unit" if r["setting"] is False else "once"), where
            units = r["units"]
            if r["path"] == "once":
                assert r["all_gathers"] == units, where
            else:  # every unit at each of the steps' forwards (the root once per forward at most)
                assert r["all_gathers"] >= (units - 1) * NEW_TOKENS, where
    # the tokens are no trivial sequence, and rank 0 stopped early where rank 1 did not
    prompt = _ids(0).shape[1]
    assert len(results[0][0]["expected"]["greedy"][0]) < prompt + NEW_TOKENS
    assert len(results[1][0]["expected"]["greedy"][0]) == prompt + NEW_TOKENS
    assert results[1][0]["expected"]["greedy"] != results[1][0]["expected"]["sampled"]
    assert results[0][0]["units"] > 1


#: a ZeRO-3 ds_config: on DeepSpeed, TRL would gather with deepspeed.zero.GatheredParameters
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}


def _trl_run(deepspeed, gather: bool, tmp: str, rank: int) -> dict:
    """A GRPO step's generation: TRL's own config class through the mixin, TRL's unwrap around generate."""
    from dataclasses import dataclass

    import transformers
    import trl
    from trl.models import unwrap_model_for_generation

    import xshard.trainer

    @dataclass
    class Config(xshard.trainer.TrainingArgumentsMixin, trl.GRPOConfig):
        pass

    class GRPOLike(xshard.trainer.TrainerMixin, transformers.Trainer):
        pass

    args = Config(output_dir=tmp, report_to=[], deepspeed=deepspeed, per_device_train_batch_size=2,
                  num_generations=2, use_cpu=True, ds3_gather_for_generation=gather)
    trainer = GRPOLike(model=_qwen2(), args=args)
    model = trainer.accelerator.prepare(trainer.model)
    model.eval()
    ids = _ids(rank)
    model.reset_stats()
    with unwrap_model_for_generation(model, trainer.accelerator,
                                     gather_deepspeed3_params=trainer.args.ds3_gather_for_generation) as unwrapped:
        got = unwrapped.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        path = unwrapped.generate.last_path
    out = {"deepspeed": deepspeed is not None, "gather": gather, "got": got, "path": path, "units": model.stats()["units"],
           "all_gathers": model.stats()["comm"]["calls"].get("all_gather", 0),
           "expected": _qwen2().generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()}
    trainer.accelerator.end()
    return out


def _trl_worker(rank: int, world: int, tmp: str) -> list[dict]:
    return [_trl_run(deepspeed, gather, tmp, rank) for deepspeed, gather in ((None, True), (ZERO3, True), (None, False))]


def test_trl_unwrap_model_for_generation_through_the_mixin_takes_the_fast_path(tmp_path) -> None:
    """Also with a ZeRO-3 ds_config; TRL's ``ds3_gather_for_generation=False`` keeps its meaning (per unit)."""
    results = run_workers(_trl_worker, 2, str(tmp_path), timeout=240)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            where = (f"ds_config={r['deepspeed']}, ds3_gather_for_generation={r['gather']}, rank {rank}: "
                     f"{r['all_gathers']} all-gathers")
            assert r["got"] == r["expected"], where
            if r["gather"]:
                assert r["path"] == "once" and r["all_gathers"] == r["units"], where
            else:  # TRL's "do not gather": every unit at every step
                assert r["path"] == "per_unit" and r["all_gathers"] >= (r["units"] - 1) * NEW_TOKENS, where
