"""A tied-embedding model (a tiny GPT-2, ``lm_head.weight`` is ``transformer.wte.weight``) moves over from
Accelerate: the folder Accelerate's own ``save_state`` writes (its ``model.safetensors`` holds the tied
weight once) loads into an xshard job on 2 processes at stage 3, and so does a full state dict that
holds the tie under either of its names only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent

_SAVE_WITH_ACCELERATE = """
import sys, torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(7)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
acc = Accelerator(cpu=True)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
acc.save_state(sys.argv[1])
torch.save({k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}, sys.argv[1] + ".pt")
"""


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # other weights than the saved ones
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def _load_worker(rank, world_size, folder, expected_path):
    import xshard

    expected = torch.load(expected_path)
    acc = xshard.Accelerator(stage=3, seed=0)
    model = _tiny_gpt2()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = {}
    acc.load_state(folder)
    got = acc.get_state_dict(model)
    if rank == 0:
        out["accelerate_folder"] = {k: torch.equal(got[k], expected[k]) for k in expected}
    for kept in ("transformer.wte.weight", "lm_head.weight"):
        other = {"transformer.wte.weight": "lm_head.weight", "lm_head.weight": "transformer.wte.weight"}[kept]
        partial = {k: v for k, v in expected.items() if k != other}
        model.load_full_state_dict({k: torch.zeros_like(v) for k, v in expected.items()})
        model.load_full_state_dict(partial)
        got = acc.get_state_dict(model)
        if rank == 0:
            out[kept] = {k: torch.equal(got[k], expected[k]) for k in expected}
    out["still_tied"] = acc.unwrap_model(model).lm_head.weight is acc.unwrap_model(model).transformer.wte.weight
    acc.end()
    return out


def test_an_accelerate_checkpoint_and_a_full_state_dict_of_a_tied_model_load_under_either_name(tmp_path):
    folder = tmp_path / "accelerate_ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    proc = subprocess.run([sys.executable, "-c", _SAVE_WITH_ACCELERATE, str(folder)], capture_output=True,
                          text=True, timeout=270, env={**env, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert len({"lm_head.weight", "transformer.wte.weight"} & stored) == 1  # Accelerate keeps one name

    results = run_workers(_load_worker, 2, str(folder), str(folder) + ".pt")
    for name in ("accelerate_folder", "transformer.wte.weight", "lm_head.weight"):
        matches = results[0][name]
        assert matches and all(matches.values()), (name, [k for k, ok in matches.items() if not ok])
    assert all(r["still_tied"] for r in results)
