"""Trainer-based programs nobody here wrote, unedited, on xshard: ``xshard launch --trainer``.

- TRL's ``trl/scripts/sft.py`` as the installed package ships it, on 2 processes at stage 3 from the
  launcher's ``--config`` (a ds_config whose "auto" values TRL's ``SFTConfig`` fills): the per-step losses of
  the same script on stock Accelerate's DDP (torchrun, ``ACCELERATE_USE_CPU``), with the checkpoints saved.
  The tiny Qwen2 has no dropout (its attention dropout is 0), so the two runs draw nothing differently.
- A framework in LLaMA-Factory's shape (tests/support/framework_sft.py, run by its launcher module: its own ``Seq2SeqTrainingArguments``
  subclass and ``Seq2SeqTrainer`` subclass, a yaml parsed by ``HfArgumentParser`` with transformers 4's
  ``warmup_ratio``), run as a module: it trains at stage 3, saves checkpoints whose ``training_args.bin``
  loads as the framework's own class, and a run resumed from a checkpoint logs the uninterrupted run's losses.
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
DATA = ROOT / "examples" / "qwen_finetune" / "data" / "alpaca_synthetic.json"
XSHARD_2 = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
NOT_ON_XSHARD = "no process of this job built an xshard Accelerator"
TIMEOUT = 240  # each run takes about 15-25 s on an idle 2-core machine (run_job shortens it to the test's deadline)
# a ds_config as DeepSpeed users write it: "auto" values the Trainer fills from its arguments
DS_STAGE3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    # no hub telemetry thread (TRL's trainers ping the hub from rank 0): every path here is local
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1",
               HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def _run(command: list[str], cwd: Path, **env: str):
    done = run_job(command, timeout=TIMEOUT, cwd=cwd, env=_env(**env))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert NOT_ON_XSHARD not in done.stderr
    return done


def _logged_losses(checkpoint: Path) -> dict[int, float]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def _saved_model_and_checkpoints(out: Path) -> bool:
    """sft.py's run wrote all it writes: its checkpoints, then save_model's folder (training_args.bin last)."""
    return all((out / name).is_file() for name in ("checkpoint-4/trainer_state.json", "model.safetensors",
                                                   "training_args.bin"))


def _text_records(folder: Path, count: int = 32) -> Path:
    records = json.loads(DATA.read_text())[:count]
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"text": f"{r['instruction']}\n{r['input']}\n{r['output']}"}) + "\n")
    return folder / "train.jsonl"


def _stage3_config(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_STAGE3))
    return path


def test_trls_shipped_sft_script_unedited_under_the_switch_gives_trls_losses(tiny_model, tmp_path):
    import trl

    sft = Path(trl.__file__).parent / "scripts" / "sft.py"  # as the installed package ships it
    data = _text_records(tmp_path / "data").parent
    args = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--max_steps", "4",
            "--per_device_train_batch_size", "2", "--logging_steps", "1", "--save_steps", "2", "--report_to", "none",
            "--bf16", "false", "--max_length", "64", "--seed", "0", "--learning_rate", "1e-3"]
    config = _stage3_config(tmp_path)
    ours = _run([*XSHARD_2, "--trainer", "--config", str(config), str(sft), *args,
                 "--output_dir", str(tmp_path / "xshard")], tmp_path, XSHARD_BACKEND="cpu")
    assert "stage 3: parameters sharded over all 2 rank(s)" in ours.stderr, ours.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "xshard").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (tmp_path / "xshard" / "model.safetensors").is_file()  # its trainer.save_model() at the end

    anchor_out = tmp_path / "anchor"
    done = run_anchor([*TORCHRUN_2, str(sft), *args, "--output_dir", str(anchor_out)], timeout=TIMEOUT, cwd=tmp_path,
                      env=_env(ACCELERATE_USE_CPU="true"), written=lambda: _saved_model_and_checkpoints(anchor_out))
    assert done.ok, done.stdout[-3000:] + done.stderr[-5000:]
    losses = _logged_losses(tmp_path / "xshard" / "checkpoint-4")
    anchor = _logged_losses(anchor_out / "checkpoint-4")
    assert list(losses) == [1, 2, 3, 4]
    assert losses == pytest.approx(anchor, rel=1e-6, abs=1e-6)


def _framework_yaml(path: Path, model: Path, data: Path, out: Path, resume: Path | None = None) -> Path:
    lines = [f"model_name_or_path: {model}", f"dataset: {data}", "cutoff_len: 64", f"output_dir: {out}",
             "stage: sft", "per_device_train_batch_size: 2", "learning_rate: 1.0e-3", "lr_scheduler_type: cosine",
             "warmup_ratio: 0.25", "max_steps: 4", "logging_steps: 1", "save_steps: 2", "report_to: none",
             "seed: 0"]
    if resume is not None:
        lines.append(f"resume_from_checkpoint: {resume}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_framework_with_its_own_trainer_and_arguments_classes_trains_saves_and_resumes_unedited(tiny_model,
                                                                                                  tmp_path):
    data = _text_records(tmp_path / "data")
    config = _stage3_config(tmp_path)
    full_yaml = _framework_yaml(tmp_path / "full.yaml", tiny_model, data, tmp_path / "full")
    full = _run([*XSHARD_2, "--trainer", "--config", str(config), "-m", "support.framework_launcher", str(full_yaml)],
                tmp_path, XSHARD_BACKEND="cpu")
    assert "framework: CustomSeq2SeqTrainer computed 4 losses" in full.stdout, full.stdout[-2000:]
    assert "stage 3: parameters sharded over all 2 rank(s)" in full.stderr, full.stderr[-3000:]
    uninterrupted = _logged_losses(tmp_path / "full" / "checkpoint-4")
    assert list(uninterrupted) == [1, 2, 3, 4]

    # the checkpoint's arguments: the framework's own class (loads without xshard), as parsed from the yaml
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        saved = torch.load(tmp_path / "full" / "checkpoint-2" / "training_args.bin", weights_only=False)
    finally:
        sys.path.remove(str(ROOT / "tests"))
    assert type(saved).__qualname__ == "FinetuningArguments" and type(saved).__module__ == "support.framework_sft"
    assert type(saved).__mro__[1].__name__ == "Seq2SeqTrainingArguments"  # the stock class, not xshard's
    assert (saved.stage, saved.warmup_steps, saved.world_size) == ("sft", 0.25, 2)

    # a job stopped after step 2 resumes from its checkpoint (a copy) to the uninterrupted run's losses
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed_yaml = _framework_yaml(tmp_path / "resumed.yaml", tiny_model, data, tmp_path / "resumed",
                                   resume=tmp_path / "resumed" / "checkpoint-2")
    resumed = _run([*XSHARD_2, "--trainer", "--config", str(config), "-m", "support.framework_launcher",
                    str(resumed_yaml)], tmp_path, XSHARD_BACKEND="cpu")
    assert "framework: CustomSeq2SeqTrainer computed 2 losses" in resumed.stdout, resumed.stdout[-2000:]
    after = _logged_losses(tmp_path / "resumed" / "checkpoint-4")
    assert {step: after[step] for step in (3, 4)} == pytest.approx({3: uninterrupted[3], 4: uninterrupted[4]},
                                                                   rel=1e-6)
