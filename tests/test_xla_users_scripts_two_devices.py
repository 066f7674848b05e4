"""The users' scripts on two real torch_xla (XLA:CPU) devices, through their own entry points.

- examples/minimal.py on two XLA:CPU devices, started by ``xshard launch`` as docs/backends.md says, learns
  as two CPU processes do. Not to the last digit: XLA:CPU's replicas are threads of one process, whose models
  draw their random initial weights from one shared generator, so rank 0's weights (which ``prepare``
  broadcasts, as DDP does) are not always those of a fresh ``torch.manual_seed(0)``: the loss falls alike,
  within a factor the test states.
- examples/qwen_finetune/finetune.py (the Trainer) on two devices trains, logs and saves.

Each two-device job runs alone in its test, never beside another of this file's jobs: XLA:CPU's in-process
collectives abort after a fixed 10 s (docs/backends.md). The one-device scripts are in test_xla_users_scripts.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.xla_scripts import ROOT, XLA_ENV, env_the_launcher_decides, epoch_losses, run_script

pytestmark = pytest.mark.xla


def test_the_readmes_two_device_command_learns_as_two_cpu_processes_do() -> None:
    """`XSHARD_BACKEND=xla PJRT_DEVICE=CPU xshard launch --nproc 2 examples/minimal.py`, as docs/backends.md
    gives it (2048 samples, 4 epochs: 256 steps a replica), once, with no retry; then the same command on
    two CPU processes, whose losses it must follow."""
    pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    env = env_the_launcher_decides()
    cmd = [sys.executable, "-m", "xshard", "launch", "--nproc", "2", "examples/minimal.py"]
    proc = subprocess.run(cmd, env={**env, **XLA_ENV}, cwd=ROOT, capture_output=True, text=True, timeout=270)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Termination timeout" not in proc.stderr, proc.stderr[-4000:]
    two_xla = epoch_losses(proc.stdout)
    two_cpu = epoch_losses(run_script(cmd, {"XSHARD_BACKEND": "cpu"}))
    for losses in (two_xla, two_cpu):
        assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], (two_xla, two_cpu)
    # Rank 0's initial weights depend on how the replica threads interleave their draws from the shared
    # generator (module docstring), so the loss is not the CPU processes' to the last digit: measured at
    # this size, 0.0185 and 0.0204 against the CPU processes' 0.0207 (at 256 samples, 10 runs: 0.043-0.082
    # against 0.0572).
    assert 0.5 * two_cpu[-1] <= two_xla[-1] <= 2 * two_cpu[-1], (two_xla, two_cpu)


def _qwen_trainer_losses(out: Path, nproc_env: dict[str, str]) -> list[float]:
    """examples/qwen_finetune/finetune.py on 2 devices under `xshard launch`, with the tiny-model arguments of
    its README (20 steps); the losses it logs every 10 steps, after it saved the model at the end."""
    cmd = [sys.executable, "-m", "xshard", "launch", "--nproc", "2", "finetune.py", "--deepspeed",
           "ds_config_zero3.json", "--output_dir", str(out), "--max_steps", "20", "--per_device_train_batch_size", "4",
           "--model_max_length", "256", "--learning_rate", "3e-3", "--warmup_ratio", "0.03", "--lr_scheduler_type",
           "cosine", "--seed", "1234", "--logging_steps", "10", "--save_strategy", "no"]
    env = env_the_launcher_decides()
    proc = subprocess.run(cmd, env={**env, **nproc_env}, cwd=ROOT / "examples" / "qwen_finetune", capture_output=True,
                          text=True, timeout=270)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "model.safetensors").is_file() and (out / "training_args.bin").is_file()
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_the_qwen_trainer_script_trains_logs_and_saves_on_two_xla_devices(tmp_path: Path) -> None:
    """The Qwen example's Trainer script on 2 XLA:CPU devices, as written: the Trainer gathers its logged loss
    with ``xm.mesh_reduce`` (torch_xla's collectives without channel ids, which XLA:CPU's replica threads never
    matched: the job aborted at the first logging step), and ``save_model`` pickles the script's own
    TrainingArguments subclass (which failed once the other replica thread had returned). Its losses follow
    the same command on 2 CPU processes."""
    pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    on_xla = _qwen_trainer_losses(tmp_path / "xla", XLA_ENV)
    # (transformers takes its TPU paths wherever torch_xla is installed, as here, and on CPU processes its
    # logged loss was rank 0's alone: 5.44, 9.02, 9.34, 1.02 ... step by step; the launcher turns them off)
    on_cpu = _qwen_trainer_losses(tmp_path / "cpu", {"XSHARD_BACKEND": "cpu"})
    assert len(on_xla) == len(on_cpu) == 2 and on_xla[1] < on_xla[0], (on_xla, on_cpu)
    # rank 0's initial weights depend on how the replica threads share the random generator (module
    # docstring); measured: 5.59 and 4.49 on XLA, 5.67 and 4.59 on the CPU processes
    for a, b in zip(on_xla, on_cpu, strict=True):
        assert abs(a - b) <= 0.05 * b, (on_xla, on_cpu)
