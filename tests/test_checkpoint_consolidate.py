"""`xshard consolidate`: a sharded checkpoint of a transformers model -> a from_pretrained folder."""

from __future__ import annotations

import os

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess


def _qwen_worker(rank, world_size, folder):
    from support.models import make_qwen2

    import xshard

    acc = xshard.Accelerator(config={"stage": 3, "auto_wrap_policy": "transformer"}, seed=0)
    model = make_qwen2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ids = torch.arange(12).reshape(2, 6) % 61
    out = model(input_ids=ids, labels=ids)
    acc.backward(out.loss)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    acc.save_state(os.path.join(folder, "ckpt"), state_dict_type="sharded")
    return logits


def test_a_sharded_qwen2_checkpoint_consolidates_to_a_folder_from_pretrained_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from xshard.cli import main

    logits = run_workers(_qwen_worker, 2, str(tmp_path))[0]
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "export")]) == 0
    assert sorted(os.listdir(tmp_path / "export")) == ["config.json", "model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    with torch.no_grad():
        ids = torch.arange(12).reshape(2, 6) % 61
        assert torch.equal(model(input_ids=ids).logits, logits)


def test_consolidate_names_the_problem(tmp_path, capsys):
    from xshard.cli import main

    (tmp_path / "half").mkdir()
    assert main(["consolidate", str(tmp_path / "half"), str(tmp_path / "out.safetensors")]) == 2
    assert "xshard_state.json is missing" in capsys.readouterr().err
