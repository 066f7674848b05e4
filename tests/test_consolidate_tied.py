"""`xshard consolidate` of a model with tied weights (a Qwen2 whose ``lm_head`` is its embedding): the exported
folder holds the tie once, under its first name, as transformers' ``save_pretrained`` writes it, and
``from_pretrained`` ties it back to the trained values."""

from __future__ import annotations

import torch
from safetensors import safe_open
from support.models import make_qwen2

import xshard
from xshard.checkpoint.consolidate import consolidate, consolidated_state_dict


def test_a_tied_weight_is_exported_once_and_loads_tied(tmp_path, clean_env):
    from transformers import AutoModelForCausalLM

    acc = xshard.Accelerator(stage=3, seed=0)
    model = make_qwen2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(1))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    acc.save_state(str(tmp_path / "ckpt"))
    trained = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    acc.end()

    state = consolidated_state_dict(tmp_path / "ckpt")
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]  # every name, the one tensor
    weights = consolidate(tmp_path / "ckpt", tmp_path / "export")
    with safe_open(str(weights), framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert len(keys) == len(trained) - 1

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
