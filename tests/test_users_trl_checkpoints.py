"""A user's TRL SFT script with checkpoints on, through ``xshard.trainer.TrainerMixin`` with TRL's own
``SFTConfig``, on 2 processes under ``xshard launch`` (tests/support/trl_sft_script.py): the Trainer writes
``checkpoint-N`` (with ``training_args.bin``, ``torch.save(self.args)``) and rotates them to
``save_total_limit``; a run resumed from its step-4 checkpoint with ``resume_from_checkpoint`` logs, after the resume
point, the losses of the uninterrupted run; ``trainer.save_model()``'s folder loads with ``from_pretrained``;
and the uninterrupted run's losses are those of TRL's own ``SFTTrainer`` on plain Accelerate's DDP
(torchrun, ``ACCELERATE_USE_CPU``: its multi-CPU data parallel), checkpointing the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import run_anchor, run_job

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "trl_sft_script.py"
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"
XSHARD_2 = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# 6 steps of 8 records (4 a process), a checkpoint every 2 steps and the newest two kept
CHECKPOINTS = ["--max_steps", "6", "--save_steps", "2", "--save_total_limit", "2"]
TIMEOUT = 240  # each run takes about 15-25 s on an idle 2-core machine (run_job shortens it to the test's deadline)


def _run(launcher: list[str], model: Path, out: Path, *options: str, trainer: str = "xshard") -> dict:
    """The script's run as its user starts it; what the run itself logged and saved (its ``RunRecord``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if trainer == "stock":
        env["ACCELERATE_USE_CPU"] = "true"
    command = [*launcher, str(SCRIPT), str(model), str(DATA), str(out), *CHECKPOINTS, *options]
    if trainer == "stock":  # the anchor's exit is not under test: its record, once written, is read
        anchor = run_anchor(command, timeout=TIMEOUT, cwd=ROOT, env=env, written=(out / "this_run.json").is_file)
        assert anchor.ok, anchor.stdout[-3000:] + anchor.stderr[-5000:]
        return json.loads((out / "this_run.json").read_text())
    proc = run_job(command, timeout=TIMEOUT, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "this_run.json").read_text())


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def _losses(record: dict) -> dict[int, float]:
    return {int(step): loss for step, loss in record["logged"]}


def test_trl_sft_script_checkpoints_rotates_and_resumes_on_two_processes(tiny_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full = _run(XSHARD_2, tiny_model, tmp_path / "full", "--save_model")
    assert full["saved"] == [2, 4, 6] and _checkpoints(tmp_path / "full") == ["checkpoint-4", "checkpoint-6"]
    uninterrupted = _losses(full)
    assert list(uninterrupted) == [1, 2, 3, 4, 5, 6]

    # a job that stopped after step 4 holds what the uninterrupted one held then: its checkpoint-4 (a copy,
    # which also shows a checkpoint is self-contained); the same script resumes from it to the end
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint-4", out / "checkpoint-4")
    resumed = _run(XSHARD_2, tiny_model, out, "--resume_from_checkpoint", str(out / "checkpoint-4"), "--save_model")
    assert resumed["saved"] == [6] and _checkpoints(out) == ["checkpoint-4", "checkpoint-6"]
    # only the steps after the resume point ran, with the uninterrupted run's losses
    assert _losses(resumed) == pytest.approx({5: uninterrupted[5], 6: uninterrupted[6]}, rel=1e-6)

    # save_model(): whole weights that from_pretrained loads, equal to the uninterrupted run's
    weights = load_file(tmp_path / "full" / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()
    for name, value in weights.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the arguments each checkpoint and save_model wrote: TRL's SFTConfig, describing the 2-process run
    for folder in (out, out / "checkpoint-6"):
        args = torch.load(folder / "training_args.bin", weights_only=False)
        assert type(args).__name__ == "SFTConfig" and args.max_steps == 6 and args.save_total_limit == 2
        assert (args.world_size, args.process_index) == (2, 0)

    # the anchor: TRL's own SFTTrainer on plain Accelerate's DDP, the same script and checkpoints
    anchor = _run(TORCHRUN_2, tiny_model, tmp_path / "anchor", trainer="stock")
    assert anchor["saved"] == [2, 4, 6] and _checkpoints(tmp_path / "anchor") == ["checkpoint-4", "checkpoint-6"]
    assert uninterrupted == pytest.approx(_losses(anchor), rel=1e-5)
