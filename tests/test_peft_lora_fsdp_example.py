"""examples/peft_lora_fsdp: the PEFT guide's LoRA + FSDP flow under `xshard launch --nproc 2` with the guide's yaml.

Offline: a tiny random T5 and a word-level tokenizer built by make_tiny.py, synthetic
FinancialPhraseBank-style data (37 validation sentences: the last evaluation batch is uneven).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.jobs import run_job

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "peft_lora_fsdp"


@pytest.fixture(scope="module")
def guide_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("peft")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XSHARD_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(EXAMPLE / "make_tiny.py"), str(work)], check=True, env=env, timeout=120,
                   capture_output=True)
    proc = run_job(
        [sys.executable, "-m", "xshard", "launch", "--nproc", "2", "--config", str(EXAMPLE / "fsdp_config.yaml"),
         str(EXAMPLE / "peft_lora_seq2seq_accelerate_fsdp.py"), "--model_name_or_path", str(work / "tiny-t5"),
         "--data_dir", str(work / "data"), "--output_dir", str(work / "out")],
        timeout=270, cwd=work, env=env)
    return work, proc


def test_the_guides_flow_trains_evaluates_and_saves_the_adapter(guide_run):
    work, proc = guide_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "len(eval_preds)=37" in proc.stdout  # gather_for_metrics: every validation sentence once
    accuracy = float(re.search(r"accuracy=([0-9.]+)", proc.stdout).group(1))
    assert 0.0 <= accuracy <= 100.0
    predictions = re.search(r"eval_preds\[:10\]=(\[.*\])", proc.stdout).group(1)
    assert any(label in predictions for label in ("positive", "negative", "neutral"))  # generated label words
    saved = list((work / "out").iterdir())
    assert len(saved) == 1 and {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in saved[0].iterdir()}


def test_the_saved_adapter_loads_in_peft(guide_run):
    """``model.save_pretrained`` of the prepared PeftModel must write whole LoRA weights (not this rank's
    shards), which needs ``model.state_dict()`` to return full tensors at stage 3."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    work, proc = guide_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = next((work / "out").iterdir())
    model = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained(work / "tiny-t5"), folder)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(torch.count_nonzero(p) > 0 for p in lora_b)  # trained: LoRA B starts at zero
