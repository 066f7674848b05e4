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
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "no_trainer_clm_script.py"


def _run(launcher: list[str], accelerator: str, cwd: Path, *args: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(ACCELERATOR=accelerator, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if accelerator == "accelerate":
        env["ACCELERATE_USE_CPU"] = "true"
    try:  # under pytest-timeout's 300 s, so that a hung run is named with its output so far
        proc = subprocess.run([*launcher, str(SCRIPT), *args], capture_output=True, text=True, timeout=240,
                              cwd=cwd, env=env)
    except subprocess.TimeoutExpired as exc:
        out = [(s.decode(errors="replace") if isinstance(s, bytes) else s or "") for s in (exc.stdout, exc.stderr)]
        pytest.fail(f"the run on {accelerator} ({' '.join(args)}) did not end in 240 s (about 10 s when idle); "
                    f"its output so far:\n{out[0][-2000:]}\n{out[1][-4000:]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]  # printed by the main process only
    return json.loads(lines[0][len("RESULT "):]), proc.stderr


def test_no_trainer_script_gives_accelerates_losses_and_resumes_exactly(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    xshard = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
    flags = ("--with_tracking", "--checkpointing_steps", "3")
    reference, _ = _run(torchrun, "accelerate", tmp_path, "--output_dir", "acc", *flags)
    ours, log = _run(xshard, "xshard", tmp_path, "--output_dir", "xs", *flags)

    assert len(ours["step_losses"]) == len(reference["step_losses"]) == 8  # 2 epochs x 4 micro-steps
    assert ours["step_losses"] == pytest.approx(reference["step_losses"], rel=1e-5)
    assert ours["eval_losses"] == pytest.approx(reference["eval_losses"], rel=1e-5)
    assert ours["eval_count"] == reference["eval_count"] == 15
    for rank in (0, 1):  # logger.info(accelerator.state, main_process_only=False)
        assert f"[rank {rank}/2] INFO __main__: Distributed environment: FSDP" in log
    assert list((tmp_path / "xs" / "clm_no_trainer").glob("events.out.tfevents.*"))

    for source in ("xs", "acc"):
        resumed, _ = _run(xshard, "xshard", tmp_path, "--output_dir", f"resumed_{source}",
                          "--resume_from_checkpoint", str(tmp_path / source / "step_3"))
        assert resumed["step_losses"] == pytest.approx(ours["step_losses"][6:], rel=1e-5), source
        assert resumed["eval_losses"] == pytest.approx(ours["eval_losses"][1:], rel=1e-5), source
