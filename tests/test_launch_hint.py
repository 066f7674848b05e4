"""The line ``xshard launch`` ends a job with when no process built an xshard Accelerator names the fix that
fits the program as it is written: the import for a script that imports transformers' Trainer, the mixin
for a script that subclasses a Trainer, ``--trainer`` for TRL's scripts, modules and framework entries
(which have no import to change), ``from xshard import Accelerator`` for an Accelerate script."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from support.jobs import run_job

from xshard.cli.launch import not_on_xshard_message
from xshard.cli.launch_hint import program_fix

ROOT = Path(__file__).resolve().parent.parent
HINT = "xshard launch: no process of this job built an xshard Accelerator"
SWITCH = "xshard launch --trainer"

STOCK_TRAINER = """
from transformers import Trainer, TrainingArguments
trainer = Trainer(model=model, args=TrainingArguments("out"))
"""
SUBCLASS = """
import trl
class MyTrainer(trl.SFTTrainer):
    pass
"""
TRL_TRAINER = """
from trl import SFTConfig, SFTTrainer
SFTTrainer(model="m", args=SFTConfig("out")).train()
"""
ACCELERATE = """
from accelerate import Accelerator
accelerator = Accelerator()
"""


def _fix(tmp_path: Path, source: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(source)
    return program_fix(str(script), module=False)


def test_a_script_importing_transformers_trainer_is_told_the_import(tmp_path):
    assert _fix(tmp_path, STOCK_TRAINER) == "change its import to `from xshard.trainer import Trainer, TrainingArguments`"


def test_a_script_subclassing_a_trainer_is_told_the_mixin_or_the_switch(tmp_path):
    fix = _fix(tmp_path, SUBCLASS)
    assert "put `xshard.trainer.TrainerMixin` first in the bases of MyTrainer" in fix and SWITCH in fix
    assert "change its import" not in fix


def test_trl_scripts_modules_and_framework_entries_are_told_the_switch(tmp_path):
    import trl

    assert SWITCH in _fix(tmp_path, TRL_TRAINER) and "trl's SFTTrainer" in _fix(tmp_path, TRL_TRAINER)
    shipped = Path(trl.__file__).parent / "scripts" / "sft.py"  # imports SFTTrainer inside its main()
    assert SWITCH in program_fix(str(shipped), module=False)
    for module in ("trl.scripts.sft", "llamafactory.launcher"):
        fix = program_fix(module, module=True)
        assert SWITCH in fix and "change its import to `from xshard.trainer" not in fix


def test_an_accelerate_script_is_told_the_accelerator_import_only(tmp_path):
    assert _fix(tmp_path, ACCELERATE) == "change its import to `from xshard import Accelerator`"


def test_the_line_with_the_switch_on_says_no_trainer_was_built(tmp_path):
    fix = program_fix("x.py", module=False, switch=True)
    line = not_on_xshard_message({}, {}, fix=fix)
    assert line.startswith(HINT) and "--trainer was on, yet no transformers Trainer was built" in line


@pytest.mark.multiprocess
def test_trls_module_run_without_the_switch_ends_with_the_switch_named(tmp_path):
    # TRL's SFT script as a module: `--help` ends it before it builds a Trainer, as a crash before training would
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(PYTHONPATH=str(ROOT), XSHARD_BACKEND="cpu", OMP_NUM_THREADS="1")
    done = run_job([sys.executable, "-m", "xshard", "launch", "--nproc", "2", "-m", "trl.scripts.sft", "--help"],
                   timeout=180, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if HINT in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert SWITCH in lines[0] and "from xshard.trainer import" not in lines[0], lines[0]
