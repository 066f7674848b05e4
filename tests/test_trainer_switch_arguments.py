"""What the stock argument classes mean under the switch (``python -m xshard.trainer.patch program.py``): a
program that builds transformers' own ``TrainingArguments`` (or parses them with ``HfArgumentParser``) gets
xshard's meaning of each argument with no edit, so the arguments mixin is optional:

- ``deepspeed=`` a ds_config with "auto" values, without DeepSpeed installed (the stock class demands it):
  its stage, its "auto" values filled from the arguments;
- ``--fsdp`` words, and transformers 4's ``--warmup_ratio`` on the command line (no such field in the stock
  class);
- ``bf16`` on a CPU, which the stock class refuses without ``--use_cpu``: the device is asked instead;
- ``torch.save(args)`` writes the program's own class (it loads without xshard), ``copy.deepcopy`` keeps
  xshard's meaning; a Trainer subclass defined by the program runs on xshard's Accelerator.

The program runs in one process (a child, so the switch stays out of the test process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = r'''
import copy, io, sys
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

assert "xshard" not in sys.modules["__main__"].__dict__  # the program itself never imports xshard
ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
args = TrainingArguments("out", deepspeed=ds, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                         max_grad_norm=0.5, bf16=True, report_to="none")
config = args.xshard_config
print("deepspeed:", config.stage, config.gradient_accumulation_steps, config.gradient_clipping, args.bf16)

(parsed,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(sys.argv[1:])
print("parsed:", parsed.xshard_fsdp_words, parsed.warmup_steps, parsed.xshard_config.stage)
print("to_dict has warmup_ratio:", "warmup_ratio" in parsed.to_dict())

buffer = io.BytesIO()
torch.save(parsed, buffer)
buffer.seek(0)
loaded = torch.load(buffer, weights_only=False)
print("saved as stock:", type(loaded) is TrainingArguments, "copy keeps:", type(copy.deepcopy(parsed)) is type(parsed))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, x, labels=None):
        return {"loss": self.layer(x).sum()}

class MyTrainer(Trainer):
    pass

trainer = MyTrainer(model=Model(), args=args)
print("trainer:", type(trainer).__name__, isinstance(trainer, MyTrainer), type(trainer.accelerator).__module__)
'''


def test_stock_arguments_and_trainers_get_xshards_meaning_under_the_switch(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(PYTHONPATH=str(ROOT), XSHARD_BACKEND="cpu")
    command = [sys.executable, "-m", "xshard.trainer.patch", str(program), "--output_dir", "out",
               "--fsdp", "full_shard auto_wrap", "--warmup_ratio", "0.1", "--report_to", "none"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["deepspeed"] == "2 2 0.5 True"
    assert lines["parsed"] == "['full_shard', 'auto_wrap'] 0.1 3"
    assert lines["to_dict has warmup_ratio"] == "False"
    assert lines["saved as stock"] == "True copy keeps: True"
    assert lines["trainer"] == "MyTrainer True xshard.trainer.accelerator_setup"
