"""A transformers ``*_no_trainer``-style script (tests/support/no_trainer_clm_script.py) gives Accelerate's numbers on xshard.

Run on 2 processes with Accelerate (torchrun, ``ACCELERATE_USE_CPU``: its multi-CPU data parallel) and
with xshard (``xshard launch``, its default stage 3), the data order fixed as the script describes:

- every micro-step's loss and each epoch's eval loss (``gather_for_metrics(loss.repeat(bs))`` over 15
  samples, an uneven last batch) agree, and 15 values are kept, not 16;
- the logger from ``get_logger(__name__)`` takes ``main_process_only=False`` (both ranks log the state);
- ``--resume_from_checkpoint step_3`` continues exactly (the same last micro-step losses and eval
  loss), from xshard's own checkpoint and from the one Accelerate's ``save_state`` wrote (a tied
  GPT-2: its ``model.safetensors`` holds the tied embedding once).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support.jobs import run_writing

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "no_trainer_clm_script.py"


def _env(accelerator: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(ACCELERATOR=accelerator, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if accelerator == "accelerate":
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def _run(launcher: list[str], accelerator: str, cwd: Path, output_dir: str, *args: str) -> tuple[dict, str]:
    """A run's result (``<output_dir>/result.json``, also printed once, by the main process only) and its log.
    Accelerate's exit is not under test (``support.jobs.run_writing``: stock gloo's teardown in ``end_training``
    hung rank 0 after the result, once in a busy CI run)."""
    result = cwd / output_dir / "result.json"
    out, err = run_writing([*launcher, str(SCRIPT), "--output_dir", output_dir, *args], [result],
                           anchor=accelerator == "accelerate", timeout=240, cwd=cwd, env=_env(accelerator))
    written = json.loads(result.read_text())
    if accelerator == "xshard":
        assert [line for line in out.splitlines() if line.startswith("RESULT ")] == [f"RESULT {json.dumps(written)}"]
    return written, err


def test_no_trainer_script_gives_accelerates_losses_and_resumes_exactly(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    xshard = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
    flags = ("--with_tracking", "--checkpointing_steps", "3")
    reference, _ = _run(torchrun, "accelerate", tmp_path, "acc", *flags)
    ours, log = _run(xshard, "xshard", tmp_path, "xs", *flags)

    assert len(ours["step_losses"]) == len(reference["step_losses"]) == 8  # 2 epochs x 4 micro-steps
    assert ours["step_losses"] == pytest.approx(reference["step_losses"], rel=1e-5)
    assert ours["eval_losses"] == pytest.approx(reference["eval_losses"], rel=1e-5)
    assert ours["eval_count"] == reference["eval_count"] == 15
    for rank in (0, 1):  # logger.info(accelerator.state, main_process_only=False)
        assert f"[rank {rank}/2] INFO __main__: Distributed environment: FSDP" in log
    assert list((tmp_path / "xs" / "clm_no_trainer").glob("events.out.tfevents.*"))

    for source in ("xs", "acc"):
        resumed, _ = _run(xshard, "xshard", tmp_path, f"resumed_{source}",
                          "--resume_from_checkpoint", str(tmp_path / source / "step_3"))
        assert resumed["step_losses"] == pytest.approx(ours["step_losses"][6:], rel=1e-5), source
        assert resumed["eval_losses"] == pytest.approx(ours["eval_losses"][1:], rel=1e-5), source
