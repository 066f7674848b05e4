"""Loading a Hugging Face folder shard by shard (xshard.pretrained): same weights, same logits,
only this rank's rows read; the .bin fallback; the meta-parameter hook of the core."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from support.distributed import run_workers


def tiny_qwen(tie: bool, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, use_sliding_window=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # make the norms and biases non-trivial, so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.uniform_(0.5, 1.5)
    return model


def save(folder: Path, tie: bool, safe: bool = True) -> Path:
    tiny_qwen(tie).save_pretrained(folder, safe_serialization=safe)
    if not safe and not (folder / "pytorch_model.bin").exists():  # newer transformers always write safetensors
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / "pytorch_model.bin")
    return folder


INPUT = torch.tensor([[5, 17, 42, 3, 88, 61, 7], [9, 9, 12, 55, 71, 2, 30]])


def _load_sharded(acc, folder: str, stage: int) -> dict:
    from transformers import AutoModelForCausalLM

    from xshard.pretrained import from_pretrained_sharded
    from xshard.sharding import ShardingOptions

    model = from_pretrained_sharded(AutoModelForCausalLM, folder, acc, ShardingOptions(stage=stage),
                                    dtype="auto", attn_implementation="eager")
    local = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=INPUT).logits
    module = acc.unwrap_model(model)
    return {"state": acc.full_state_dict(model), "logits": logits, "local_numel": local,
            "tied": module.lm_head.weight is module.model.embed_tokens.weight,
            "inv_freq": module.model.rotary_emb.inv_freq.clone(), "training": model.training}


def _load_all(rank: int, world_size: int, cases: dict[str, tuple[str, int]]) -> dict:
    """Every case loaded in one job (starting processes that import transformers is the slow part)."""
    import xshard
    from xshard.pretrained import SafetensorsRows

    calls: list[tuple[str, int, int]] = []
    real_call = SafetensorsRows.__call__

    def recording(self, names, start, stop, shape, dtype):
        calls.append((names[0], start, stop))
        return real_call(self, names, start, stop, shape, dtype)

    SafetensorsRows.__call__ = recording
    acc = xshard.Accelerator(seed=0)
    out = {}
    for name, (folder, stage) in cases.items():
        calls.clear()
        out[name] = _load_sharded(acc, folder, stage)
        out[name]["rows_read"] = {n: (start, stop) for n, start, stop in calls}
    acc.end()
    return out


def _reference(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=INPUT).logits
    return model, logits


CASES = {"untied": (False, True, 3), "tied": (True, True, 3), "bin": (False, False, 3),
         "stage0": (True, True, 0), "stage2": (True, True, 2)}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(results by rank, reference models and logits by case) for every case of CASES, one 2-rank job."""
    root = tmp_path_factory.mktemp("pretrained")
    folders = {}
    for name, (tie, safe, _stage) in CASES.items():
        folders[name] = save(root / name, tie, safe)
    results = run_workers(_load_all, 2, {n: (str(folders[n]), CASES[n][2]) for n in CASES}, timeout=240)
    return results, {n: _reference(folders[n]) for n in CASES}, folders


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_load_matches_from_pretrained(loaded, case):
    results, references, _ = loaded
    reference, ref_logits = references[case]
    ref_state = reference.state_dict()
    state = results[0][case]["state"]
    assert results[1][case]["state"] == {}  # the full state dict is rank 0's only
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert state[key].dtype == value.dtype, key
        assert torch.equal(state[key], value), key
    tie = CASES[case][0]
    for rank in (0, 1):
        out = results[rank][case]
        assert out["tied"] is tie
        assert out["training"] is False  # eval mode, as from_pretrained
        assert torch.equal(out["inv_freq"], reference.model.rotary_emb.inv_freq)
        torch.testing.assert_close(out["logits"], ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_stage3_ranks_hold_half_and_read_only_their_rows(loaded):
    results, references, _ = loaded
    total = sum(p.numel() for p in references["untied"][0].parameters())
    local = [results[rank]["untied"]["local_numel"] for rank in (0, 1)]
    assert sum(local) == total and max(local) < 0.6 * total
    vocab = 99  # embed_tokens and lm_head have 99 rows: rank 0 reads 0:50, rank 1 50:99
    for rank in (0, 1):
        rows = results[rank]["untied"]["rows_read"]
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert rows[name] == ((0, 50) if rank == 0 else (50, vocab))
    assert results[0]["bin"]["rows_read"] == {}  # the .bin case never reads safetensors


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from xshard.backends import select
    from xshard.pretrained import CheckpointFormatError, from_pretrained_sharded
    from xshard.sharding import ShardingOptions

    folder = save(tmp_path / "model", tie=False)
    state = load_file(folder / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match="model.norm.weight"):
        from_pretrained_sharded(transformers.AutoModelForCausalLM, folder, select("cpu").cls(),
                                ShardingOptions(stage=3))


def test_folder_without_weights_says_what_is_expected(tmp_path):
    from xshard.pretrained import CheckpointFormatError, checkpoint_files

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointFormatError, match="model.safetensors"):
        checkpoint_files(tmp_path)


def test_meta_model_at_stage_0_needs_values():
    from xshard.backends import select
    from xshard.sharding import ShardingOptions, shard_model
    from xshard.sharding.materialize import meta_parameters

    with meta_parameters():
        model = torch.nn.Linear(4, 3)
    assert model.weight.is_meta
    with pytest.raises(ValueError, match="meta device"):
        shard_model(model, select("cpu").cls(), ShardingOptions(stage=0))
