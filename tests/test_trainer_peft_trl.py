"""Trainer scripts beyond the plain model: a PEFT LoRA model through xshard's Trainer, and TRL's SFTTrainer
through ``xshard.trainer.TrainerMixin`` with TRL's own ``SFTConfig``.

- LoRA on 2 processes (stage 3): the base weights stay as loaded, the adapter trains, and the adapter that
  ``save_model`` and every checkpoint write reloads in PEFT (``PeftModel.from_pretrained``) with the
  trained values.
- TRL: in one process the mixin gives TRL's own losses; on 2 processes the stock ``SFTConfig`` (which knows
  nothing of xshard) sees 2 processes, so each step reads the global batch of both.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import run_job, run_writing
from support.side_by_side import side_by_side

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "support"
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"
LAUNCH_2 = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


def _run(command: list[str], script: str, args: list[str], trainer: str = "xshard", writes: Path | None = None,
         **env_extra: str) -> None:
    """Run ``script``; a stock run on several processes names the JSON file it ``writes`` last, and is held to
    that file only (``support.jobs.run_writing``: stock gloo's teardown can hang a rank at exit)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    cmd = [*command, str(SCRIPTS / script), *args]
    if writes is not None:
        run_writing(cmd, [writes], anchor=trainer == "stock", timeout=270, cwd=ROOT, env=env)
        return
    proc = run_job(cmd, timeout=270, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_a_lora_model_trains_on_two_processes_and_its_adapter_reloads_in_peft(tiny_model, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    _run(LAUNCH_2, "trainer_sft_script.py", [
        "--model_name_or_path", str(tiny_model), "--data_path", str(DATA), "--max_records", "40",
        "--output_dir", str(out), "--lora_r", "4", "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--learning_rate", "1e-2", "--logging_steps", "1", "--report_to", "none", "--save_steps", "2",
        "--disable_tqdm", "true"])
    trained = load_file(out / "checkpoint-4" / "model.safetensors")  # the whole PEFT model, gathered
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    lora = {k: v for k, v in trained.items() if ".lora_" in k}
    assert len(lora) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert all(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # B starts at zero: it trained
    for key, value in trained.items():
        if ".lora_" not in key:  # frozen base weights: exactly as loaded
            name = key.removeprefix("base_model.model.").replace(".base_layer", "")
            torch.testing.assert_close(value, base[name], rtol=0, atol=0, msg=key)

    for folder in (out, out / "checkpoint-4"):
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder)
        state = reloaded.state_dict()
        for key, value in lora.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


def _trl_losses(out: Path) -> list[float]:
    history = json.loads((out / "log_history.json").read_text())
    return [h["loss"] for h in history if "loss" in h]


def test_trl_sft_trainer_through_the_mixin_gives_trls_losses(tiny_model, tmp_path):
    args = [str(tiny_model), str(DATA)]
    side_by_side(lambda: _run([sys.executable], "trl_sft_script.py", [*args, str(tmp_path / "stock")], trainer="stock"),
                 lambda: _run([sys.executable], "trl_sft_script.py", [*args, str(tmp_path / "xshard")]))
    stock, ours = _trl_losses(tmp_path / "stock"), _trl_losses(tmp_path / "xshard")
    assert len(ours) == len(stock) == 4
    assert ours == pytest.approx(stock, rel=1e-5)

    _run(LAUNCH_2, "trl_sft_script.py", [*args, str(tmp_path / "two")])
    history = json.loads((tmp_path / "two" / "log_history.json").read_text())
    epochs = [h["epoch"] for h in history if "loss" in h]
    # 40 records: 4 per process per step is 8 a step on 2 processes (0.2 of an epoch), 4 on one (0.1)
    assert epochs == pytest.approx([0.2, 0.4, 0.6, 0.8])
    two = _trl_losses(tmp_path / "two")
    assert two[-1] < two[0]


def test_trl_sft_with_lora_dropout_on_two_processes_gives_trls_ddp_losses(tiny_model, tmp_path):
    # dropout draws from the script's random stream at every step: anything xshard draws from it (the CPU peak
    # probe of the first throughput report did) moves every later mask (1.5e-3 apart before; equal now)
    args = [str(tiny_model), str(DATA)]
    lora = ["--lora_dropout", "0.05", "--max_steps", "6", "--save_steps", "3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    _run(torchrun, "trl_sft_script.py", [*args, str(tmp_path / "stock"), *lora], trainer="stock",
         writes=tmp_path / "stock" / "log_history.json", ACCELERATE_USE_CPU="true")
    _run(LAUNCH_2, "trl_sft_script.py", [*args, str(tmp_path / "xshard"), *lora])
    stock, ours = _trl_losses(tmp_path / "stock"), _trl_losses(tmp_path / "xshard")
    assert len(ours) == len(stock) == 6
    assert ours == pytest.approx(stock, rel=1e-5)
    assert (tmp_path / "xshard" / "checkpoint-6" / "adapter_model.safetensors").is_file()
