"""A tied model (a tiny Qwen2 with ``tie_word_embeddings``: ``lm_head.weight`` is ``embed_tokens.weight``)
trained by the ordinary Trainer script (tests/support/trainer_sft_script.py) on 2 processes at stages 3 and 0:
``save_model()``'s folder and the ``checkpoint-N`` folder store the tie once, so their ``model.safetensors``
holds the tensors ``save_pretrained`` writes for the same model (26, where a tie stored twice is 27);
``from_pretrained`` loads both to the trained weights with the tie in place, and resuming from the
checkpoint gives the uninterrupted run's loss and weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import run_job
from support.side_by_side import side_by_side

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "trainer_sft_script.py"
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"
LAUNCH_2 = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


@pytest.fixture(scope="module")
def tied_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny Qwen2 of the session, with its head tied to its embedding."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tied") / "model"
    config = Qwen2Config.from_pretrained(tiny_model)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def _keys(file: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return set(f.keys())


def _train(model: Path, out: Path, *extra: str) -> dict[int, float]:
    args = ["--model_name_or_path", str(model), "--data_path", str(DATA), "--max_records", "24",
            "--model_max_length", "64", "--output_dir", str(out), "--per_device_train_batch_size", "2",
            "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "2", "--learning_rate", "3e-3",
            "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--seed", "11", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER="xshard", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", XSHARD_BACKEND="cpu")
    proc = run_job([*LAUNCH_2, str(SCRIPT), *args], timeout=270, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    state = json.loads((out / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


def test_save_model_and_checkpoints_store_a_tie_once_and_load_back(tied_model, tmp_path) -> None:
    from transformers import Qwen2ForCausalLM

    stage3, stage0 = tmp_path / "stage3", tmp_path / "stage0"
    losses, _ = side_by_side(
        lambda: _train(tied_model, stage3, "--deepspeed", '{"zero_optimization": {"stage": 3}}'),
        lambda: _train(tied_model, stage0, "--deepspeed", '{"zero_optimization": {"stage": 0}}'))
    stock = _keys(tied_model / "model.safetensors")  # what save_pretrained writes for this model
    assert "lm_head.weight" not in stock and "model.embed_tokens.weight" in stock
    initial = Qwen2ForCausalLM.from_pretrained(tied_model).state_dict()
    for out in (stage3, stage0):
        for folder in (out, out / "checkpoint-2"):
            assert _keys(folder / "model.safetensors") == stock, folder
            loaded = Qwen2ForCausalLM.from_pretrained(folder)
            assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        final = Qwen2ForCausalLM.from_pretrained(out).state_dict()
        assert not torch.equal(final["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    # resuming from the checkpoint that stores the tie once: the uninterrupted run's step 3 and weights
    resumed_out = tmp_path / "resumed"
    resumed = _train(tied_model, resumed_out, "--deepspeed", '{"zero_optimization": {"stage": 3}}',
                     "--resume_from_checkpoint", str(stage3 / "checkpoint-2"))
    assert resumed[3] == pytest.approx(losses[3], rel=1e-5)
    expected = Qwen2ForCausalLM.from_pretrained(stage3).state_dict()
    for key, value in Qwen2ForCausalLM.from_pretrained(resumed_out).state_dict().items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=1e-5, msg=key)
