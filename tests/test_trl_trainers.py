"""TRL's trainers beyond SFT through ``xshard.trainer.TrainerMixin``, their own configs unchanged, checkpoints on:
``GRPOTrainer`` (generation in every step at stage 3, a reward function, rewards gathered across ranks with
Accelerate's own ``gather``), ``DPOTrainer`` (a reference model TRL copies from the model, sharded beside
it) and ``RewardTrainer`` (a sequence-classification model). The anchor is TRL's stock trainer running the same
script (on Accelerate's DDP for 2 processes): the per-step losses, rewards and gradient norms are equal. Each job
trains the three kinds one after the other (the script builds each its own model, config and trainer), so the
file starts 5 jobs rather than 15.

Found by this test: the throughput report's CPU peak probe drew from the script's random stream (so the second
step's sampled completions differed), and Accelerate's ``PartialState`` built for one process before the job
joined made ``accelerate.utils.gather`` return each rank's rewards alone (an ``IndexError`` in TRL on rank 1).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from support.jobs import run_writing
from support.side_by_side import side_by_side

# the 2-process fixture trains every kind three times (TRL's DDP run, xshard's, xshard's resumed): about 90 s idle
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "trl_trainers_script.py"
#: each trainer's logged value, beside the loss and gradient norm, that says it learnt alike
LEARNT = {"grpo": "reward", "dpo": "rewards/margins", "reward": "margin"}
KINDS = sorted(LEARNT)
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
LAUNCH = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]  # stage 3 (FULL_SHARD) by default


def _run(command: list[str], model: Path, out: Path, trainer: str, *extra: str,
         **env_extra: str) -> dict[str, list[tuple[float, ...]]]:
    """Train every kind in one job (the script trains them one after the other); each kind's logged steps. TRL's
    DDP run is held to its logs, not to its exit (``support.jobs.run_writing``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SFT_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    logs = {kind: out / kind / "log_history.json" for kind in KINDS}
    run_writing([*command, str(SCRIPT), ",".join(KINDS), str(model), str(DATA), str(out), *extra], list(logs.values()),
                anchor=trainer == "stock" and command == TORCHRUN, timeout=540, cwd=ROOT, env=env)
    return {kind: [(h["loss"], h[LEARNT[kind]], h["grad_norm"]) for h in json.loads(log.read_text()) if "loss" in h]
            for kind, log in logs.items()}


def _equal(ours: list[tuple[float, ...]], stock: list[tuple[float, ...]]) -> None:
    assert len(ours) == len(stock) == 4
    for step, (mine, theirs) in enumerate(zip(ours, stock, strict=True), 1):
        # abs 2e-6: DPO's reward margin is a difference of two rewards of about 1, whose last bits (fp32, another
        # summation order) leave it 5e-7 apart, 2e-5 of the margin (measured on one machine)
        assert mine == pytest.approx(theirs, rel=1e-5, abs=2e-6), f"step {step}: {mine} != {theirs}"


@pytest.fixture(scope="module")
def one_process(tiny_model, tmp_path_factory) -> tuple[dict, dict]:
    """TRL's run and xshard's, one process each, side by side."""
    tmp = tmp_path_factory.mktemp("trl_one")
    stock, ours = side_by_side(lambda: _run([sys.executable], tiny_model, tmp / "stock", "stock"),
                               lambda: _run([sys.executable], tiny_model, tmp / "xshard", "xshard"))
    return stock, ours


@pytest.fixture(scope="module")
def two_processes(tiny_model, tmp_path_factory) -> tuple[dict, dict, dict, Path]:
    """TRL's run on Accelerate's DDP, xshard's at stage 3 (saving every 2 steps), and xshard's resumed from
    step 2; and the folder they ran in."""
    tmp = tmp_path_factory.mktemp("trl_two")
    stock = _run(TORCHRUN, tiny_model, tmp / "stock", "stock", ACCELERATE_USE_CPU="true")
    ours = _run(LAUNCH, tiny_model, tmp / "xshard", "xshard", "--save_steps", "2")
    for kind in KINDS:  # stopped after step 2
        shutil.copytree(tmp / "xshard" / kind / "checkpoint-2", tmp / "resumed" / kind / "checkpoint-2")
    resumed = _run(LAUNCH, tiny_model, tmp / "resumed", "xshard", "--resume")
    return stock, ours, resumed, tmp


@pytest.mark.parametrize("kind", KINDS)
def test_trls_trainer_through_the_mixin_gives_its_steps_in_one_process(one_process, kind):
    stock, ours = one_process
    _equal(ours[kind], stock[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_trls_trainer_at_stage_3_on_two_processes_gives_its_ddp_steps_saves_and_resumes(two_processes, kind):
    stock, ours, resumed, tmp = two_processes
    _equal(ours[kind], stock[kind])
    for step in (2, 4):
        assert (tmp / "xshard" / kind / f"checkpoint-{step}" / "trainer_state.json").is_file()
    # resumed from step 2: steps 3 and 4 (GRPO: new generations) are the uninterrupted run's
    _equal(resumed[kind], ours[kind])
