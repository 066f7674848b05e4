"""A Seq2SeqTrainer script (tests/support/seq2seq_script.py: a tiny random T5, ``predict_with_generate``
during and after training) on 2 processes: transformers' own classes under torchrun (DDP on gloo) and
``xshard.trainer``'s at stages 3 and 0 under ``xshard launch``, only the import changed.

- The runs train to the stock run's losses, evaluate with generation at every ``eval_steps`` (at stage 3
  ``generate()`` calls the encoder outside the model's forward), and ``predict()`` returns the stock run's
  generated tokens for each sample in the data set's order (the stock class also returns the last
  batch's wrap-around repeats, which xshard's gather leaves out, as ``gather_for_metrics`` does).
- ``from xshard.trainer import SFTTrainer`` (a class xshard does not ship) is an ImportError naming the mixin.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support.jobs import run_job, run_writing
from support.side_by_side import side_by_side

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "seq2seq_script.py"
ARGS = ["--max_steps", "4", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--learning_rate", "3e-3", "--predict_with_generate", "true", "--generation_max_length", "8",
        "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "no", "--logging_steps", "1",
        "--report_to", "none", "--disable_tqdm", "true", "--seed", "3"]


def _run(command: list[str], out: Path, trainer: str, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(SEQ2SEQ_TRAINER=trainer, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", XSHARD_BACKEND="cpu")
    # the stock job is held to its file only (support.jobs.run_writing: its gloo teardown can hang at exit)
    run_writing([*command, str(SCRIPT), "--output_dir", str(out), *ARGS, *extra], [out / "predictions.json"],
                anchor=trainer == "stock", timeout=270, cwd=ROOT, env=env)
    return json.loads((out / "predictions.json").read_text())


@pytest.mark.multiprocess
def test_predict_with_generate_gives_the_stock_classs_tokens_at_stages_3_and_0(tmp_path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    launch = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]
    stock, stage3, stage0 = side_by_side(
        lambda: _run(torchrun, tmp_path / "stock", "stock", "--use_cpu", "true"),
        lambda: _run(launch, tmp_path / "stage3", "xshard", "--deepspeed", '{"zero_optimization": {"stage": 3}}'),
        lambda: _run(launch, tmp_path / "stage0", "xshard", "--deepspeed", '{"zero_optimization": {"stage": 0}}'))
    samples = 6
    # the stock gather appends the wrap-around repeats of the last batch (samples 0 and 1 again)
    assert len(stock["tokens"]) == 8 and stock["tokens"][samples:] == stock["tokens"][:2]
    assert len({tuple(t) for t in stock["tokens"]}) >= 4  # varied generations, not one repeated sequence
    for run in (stage3, stage0):
        assert run["tokens"] == stock["tokens"][:samples]
        ours = [h["loss"] for h in run["log"] if "loss" in h]
        assert ours == pytest.approx([h["loss"] for h in stock["log"] if "loss" in h], rel=1e-5)
        assert [h["step"] for h in run["log"] if "eval_loss" in h] == [2, 4]  # generation ran at each evaluation


def test_a_trainer_xshard_does_not_ship_is_an_import_error_naming_the_mixin() -> None:
    with pytest.raises(ImportError, match=r"TrainerMixin, SFTTrainer\)"):
        from xshard.trainer import SFTTrainer  # noqa: F401
    with pytest.raises(ImportError, match=r"TrainingArgumentsMixin, SFTConfig\)"):
        from xshard.trainer import SFTConfig  # noqa: F401
    import xshard.trainer

    assert not hasattr(xshard.trainer, "_private")  # other names stay plain attribute errors


_ONE_PROCESS = """
import json, sys
sys.path.insert(0, {support!r})
from seq2seq_script import pairs, tiny_t5
if {stock!r}:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
else:
    from xshard.trainer import Seq2SeqTrainer, Seq2SeqTrainingArguments
args = Seq2SeqTrainingArguments(output_dir={out!r}, per_device_eval_batch_size=4, report_to="none", use_cpu=True,
                                predict_with_generate=True, generation_max_length=8)
trainer = Seq2SeqTrainer(model=tiny_t5(), args=args, eval_dataset=pairs(9, 2))
evaluated = trainer.evaluate()
predicted = trainer.predict(pairs(9, 2))
keep = lambda m: {{k: v for k, v in m.items() if not k.endswith(("runtime", "per_second", "preparation_time"))}}
print("RESULT " + json.dumps({{"evaluate": keep(evaluated), "predict": keep(predicted.metrics),
                               "tokens": predicted.predictions.tolist()}}))
"""


def test_one_process_evaluate_and_predict_give_the_stock_classs_figures(tmp_path) -> None:
    """9 samples in batches of 4: the stock class weighs the last, short batch as a whole one in eval_loss (its
    plain gather keeps ``loss.repeat(batch_size)`` whole); on one process xshard's figures are the same."""
    def run(stock: bool) -> dict:
        code = _ONE_PROCESS.format(support=str(ROOT / "tests" / "support"), stock=stock,
                                   out=str(tmp_path / ("stock" if stock else "xshard")))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
        env.update(OMP_NUM_THREADS="1", XSHARD_BACKEND="cpu")
        proc = run_job([sys.executable, "-c", code], timeout=200, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])

    stock, ours = side_by_side(lambda: run(True), lambda: run(False))
    assert ours["tokens"] == stock["tokens"] and len(stock["tokens"]) == 9
    assert ours["evaluate"] == pytest.approx(stock["evaluate"], rel=1e-6)
    assert ours["predict"] == pytest.approx(stock["predict"], rel=1e-6)
