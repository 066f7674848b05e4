"""An ordinary Accelerate script runs on xshard with only the import changed (tests/support/accelerate_gpt2_script.py).

- One process: Accelerate and xshard give the same losses, clipped norms (clipping is called on every
  micro-step, so Accelerate's clipping inside an accumulation window is compared too), learning rates
  and evaluation results.
- Two processes under ``xshard launch``: the run completes, ``gather_for_metrics`` returns 37 values
  for the 37 evaluation samples, the schedule steps as Accelerate's (twice per optimizer step), the
  TensorBoard event files hold what was logged, one automatic checkpoint is left (total_limit=1),
  and both saved models load in plain transformers with the same weights.
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
SCRIPT = Path(__file__).resolve().parent / "support" / "accelerate_gpt2_script.py"


def _run(command: list[str], out: Path, accelerator: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(ACCELERATOR=accelerator, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = run_job([*command, str(SCRIPT), "--out", str(out)], timeout=270, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]  # printed by the main process only
    return json.loads(lines[0][len("RESULT "):])


def test_accelerate_and_xshard_give_the_same_run_in_one_process(tmp_path):
    reference, ours = side_by_side(lambda: _run([sys.executable], tmp_path / "accelerate", "accelerate"),
                                   lambda: _run([sys.executable], tmp_path / "xshard", "xshard"))
    assert len(ours["losses"]) == len(reference["losses"]) == 24
    for key in ("losses", "norms", "lrs", "eval_losses"):
        assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
    assert ours["eval_counts"] == reference["eval_counts"] == [37, 37]


def _events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer: the main process's
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_xshard_launch_runs_the_script_on_2_processes_and_saves_models_transformers_loads(tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    out = tmp_path / "run"
    result = _run([sys.executable, "-m", "xshard", "launch", "--nproc", "2"], out, "xshard")
    assert result["eval_counts"] == [37, 37]  # not 38: the repeated sample of the last batch is dropped
    # 48 samples / (2 processes x batch 4) = 6 micro-steps per epoch, 3 windows of 2, over 2 epochs
    assert len(result["losses"]) == 12 and len(result["lrs"]) == 6
    # the schedule was written for 12 optimizer steps of one process: it steps twice per step here
    assert result["lrs"][-1] == pytest.approx(0.0) and result["lrs"][0] == pytest.approx(3e-3)
    assert result["losses"][-1] < result["losses"][0]

    scalars = _events(out / "gpt2")
    assert [v for _, v in scalars["train_loss"]] == pytest.approx(result["losses"][1::2], rel=1e-6)
    assert [s for s, _ in scalars["train_loss"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in scalars["eval_loss"]] == pytest.approx(result["eval_losses"], rel=1e-6)
    assert (out / "gpt2" / "hparams.yml").read_text().strip().splitlines() == ["epochs: 2", "lr: 0.003"]

    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint_1"]

    model = GPT2LMHeadModel.from_pretrained(out / "model")
    index = json.loads((out / "model_sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / "model_sharded" / f).is_file() for f in files)
    sharded = {}
    for name in files:
        sharded.update(load_file(out / "model_sharded" / name))
    state = model.state_dict()
    assert set(sharded) <= set(state) and "transformer.wte.weight" in sharded
    for key, tensor in sharded.items():
        torch.testing.assert_close(state[key], tensor, rtol=0, atol=0)
    # save_model writes weights only (as Accelerate's); with the model's config beside them, from_pretrained reads them
    model.config.save_pretrained(out / "model_sharded")
    reloaded = GPT2LMHeadModel.from_pretrained(out / "model_sharded")
    ids = torch.arange(16).unsqueeze(0)
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
