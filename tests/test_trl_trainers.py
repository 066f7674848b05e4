"""TRL's trainers beyond SFT through ``xshard.trainer.TrainerMixin``, their own configs unchanged, checkpoints on:
``GRPOTrainer`` (generation in every step at stage 3, a reward function, rewards gathered across ranks with
Accelerate's own ``gather``), ``DPOTrainer`` (a reference model TRL copies from the model, sharded beside
it) and ``RewardTrainer`` (a sequence-classification model). The anchor is TRL's stock trainer running the same script (on Accelerate's DDP for 2 processes): the
per-step losses, rewards and gradient norms are equal.

Found by this test: the throughput report's CPU peak probe drew from the script's random stream (so the second
step's sampled completions differed), and Accelerate's ``PartialState`` built for one process before the job
joined made ``accelerate.utils.gather`` return each rank's rewards alone (an ``IndexError`` in TRL on rank 1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.jobs import run_anchor
from support.side_by_side import side_by_side

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "trl_trainers_script.py"
#: each trainer's logged value, beside the loss and gradient norm, that says it learnt alike
LEARNT = {"grpo": "reward", "dpo": "rewards/margins", "reward": "margin"}
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"


def _run(kind: str, command: list[str], out: Path, trainer: str, *extra: str,
         **env_extra: str) -> list[tuple[float, ...]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    if trainer == "stock" and "torch.distributed.run" in command:  # a stock DDP anchor: its exit is not under test, its log is read
        anchor = run_anchor([*command, str(SCRIPT), kind, *extra], timeout=270, cwd=ROOT, env=env,
                            written=(out / "log_history.json").is_file)
        assert anchor.ok, anchor.stdout[-2000:] + anchor.stderr[-5000:]
    else:
        proc = subprocess.run([*command, str(SCRIPT), kind, *extra], capture_output=True, text=True, timeout=270,
                              cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    history = json.loads((out / "log_history.json").read_text())
    return [(h["loss"], h[LEARNT[kind]], h["grad_norm"]) for h in history if "loss" in h]


def _equal(ours: list[tuple[float, ...]], stock: list[tuple[float, ...]]) -> None:
    assert len(ours) == len(stock) == 4
    for step, (mine, theirs) in enumerate(zip(ours, stock, strict=True), 1):
        # abs 2e-6: DPO's reward margin is a difference of two rewards of about 1, whose last bits (fp32, another
        # summation order) leave it 5e-7 apart, 2e-5 of the margin (measured on one machine)
        assert mine == pytest.approx(theirs, rel=1e-5, abs=2e-6), f"step {step}: {mine} != {theirs}"


@pytest.mark.parametrize("kind", sorted(LEARNT))
def test_trls_trainer_through_the_mixin_gives_its_steps_in_one_process(tiny_model, tmp_path, kind):
    args = [str(tiny_model), str(DATA)]
    stock, ours = side_by_side(
        lambda: _run(kind, [sys.executable], tmp_path / "stock", "stock", *args, str(tmp_path / "stock")),
        lambda: _run(kind, [sys.executable], tmp_path / "xshard", "xshard", *args, str(tmp_path / "xshard")))
    _equal(ours, stock)


@pytest.mark.parametrize("kind", sorted(LEARNT))
def test_trls_trainer_at_stage_3_on_two_processes_gives_its_ddp_steps_saves_and_resumes(tiny_model, tmp_path, kind):
    args = [str(tiny_model), str(DATA)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launch = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]  # stage 3 (FULL_SHARD) by default
    stock = _run(kind, torchrun, tmp_path / "stock", "stock", *args, str(tmp_path / "stock"),
                 ACCELERATE_USE_CPU="true")
    ours = _run(kind, launch, tmp_path / "xshard", "xshard", *args, str(tmp_path / "xshard"), "--save_steps", "2")
    _equal(ours, stock)
    for step in (2, 4):
        assert (tmp_path / "xshard" / f"checkpoint-{step}" / "trainer_state.json").is_file()

    # stopped after step 2 and resumed: steps 3 and 4 (GRPO: new generations) are the uninterrupted run's
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "xshard" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(kind, launch, tmp_path / "resumed", "xshard", *args, str(tmp_path / "resumed"), "--resume")
    _equal(resumed, ours)
