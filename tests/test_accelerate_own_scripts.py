"""Accelerate's own test scripts, from the installed accelerate package, judge xshard's Accelerator.

Each script runs from where accelerate installed it (``accelerate/test_utils/scripts/``; never copied)
under ``xshard launch --nproc 2``, with ``tests/support/accelerate_shim.py`` putting ``xshard.Accelerator`` in
place of ``accelerate.Accelerator``; the scripts' own assertions decide. ``XSHARD_STAGE`` picks the
stage (0: replicated, Accelerate's ``MULTI_CPU`` branches; 3: sharded, its ``FSDP`` branches).

Run, and what they check:
- ``test_sync.py`` (whole script), stage 0: ``no_sync`` (gradients differ between the processes'
  replicas inside it, agree after), several forwards under ``no_sync`` then backwards with
  ``trigger_sync_in_backward`` on the last, ``accumulate`` with an optimizer and a scheduler (learning
  rates and gradients against a single-process model on the gathered batch), which data loader
  ``gradient_state`` reports while nested loaders run.
- ``test_script.py``: ``training_check`` at stage 0, with and without Accelerate's seedable sampler (a
  shuffled loader with the script's own ``torch.Generator`` trains the same scalars as one process on
  the whole batch), ``process_execution_check`` (``main_process_first``, the ``on_*process``
  decorators) and ``custom_sampler_check`` (a loader with a custom batch sampler, through Accelerate's
  ``prepare_data_loader`` over the ``AcceleratorState`` xshard fills), at stage 3.

Known gaps, run as strict xfails with the failure they show (``KnownGap``), so a fix is noticed:
- ``test_sync.py`` at stage 3: it compares each ``param.grad`` of the prepared model with a plain
  model's. At stages 1-3 ``param.grad`` holds this rank's rows of the reduced gradient after a
  window and is None inside one (the gradients are held whole in the core until the window ends, as
  FSDP2 holds them unsharded), see "Stages 1-3: what a script sees" in docs/sharded-core.md.
- ``training_check`` of ``test_script.py`` at stage 3: ``unwrap_model(model).a`` is this rank's rows
  of the scalar (shape (1,) on rank 0), which ``torch.testing.assert_close`` refuses by shape.

Excluded (functions that build Accelerate's internal objects, or need what this machine lacks):
- ``test_script.py``'s other functions: ``init_state_check`` / ``test_reinstantiated_state`` build
  ``PartialState`` / ``AcceleratorState`` from scratch; ``rng_sync_check`` and the seedable-sampler,
  ``dl_preparation_check`` / ``central_dl_preparation_check`` and ``split_between_processes_*``
  checks drive Accelerate's ``synchronize_rng_states``, ``prepare_data_loader`` /
  ``BatchSamplerShard`` / ``skip_first_batches`` and ``PartialState`` directly (no Accelerator);
  ``test_trigger`` is covered by ``tests/test_accelerate_behaviour.py``.
- ``external_deps/test_checkpointing.py``: it downloads bert-base-cased, GLUE MRPC and the ``glue`` metric
  from the Hub at run time and trains bert-base for 2 epochs. It is a strict, not-run xfail with what was
  measured here (no network: ``OSError: We couldn't connect to`` the Hub, after about 70 s of retries),
  so the suite counts it among its expected failures.
- ``external_deps/test_metrics.py``'s ``test_mrpc`` (the same downloads) runs only on a non-CPU device, by
  the script's own rule; the rest of the script (``gather_for_metrics`` over split and dispatched batches,
  a last batch divisible and not, ``drop_last``) runs here, offline: see
  ``test_metrics_script_at_stage_3``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.jobs import run_job

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().parent / "support" / "accelerate_shim.py"


class KnownGap(Exception):
    """A script failed with the failure the module docstring lists for it."""


def _scripts() -> Path:
    spec = importlib.util.find_spec("accelerate")
    assert spec is not None and spec.origin is not None, "accelerate is not installed: pip install -e '.[test]'"
    return Path(spec.origin).parent / "test_utils" / "scripts"


def _launch(tmp_path: Path, stage: int, script: str, *functions: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(XSHARD_STAGE=str(stage), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return run_job([sys.executable, "-m", "xshard", "launch", "--nproc", "2", str(SHIM), str(_scripts() / script),
                    *functions], timeout=270, cwd=tmp_path, env=env)


def _passed(proc: subprocess.CompletedProcess, *functions: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    lines = proc.stdout.splitlines()
    assert lines.count("SHIM DONE") == 2, out[-3000:]  # both processes reached the end
    for name in functions:
        assert lines.count(f"SHIM PASSED {name}") == 2, out[-3000:]


def _known(proc: subprocess.CompletedProcess, *signs: str) -> None:
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and all(sign in out for sign in signs):
        raise KnownGap(signs[-1])
    _passed(proc)


def test_sync_script_at_stage_0(tmp_path):
    _passed(_launch(tmp_path, 0, "test_sync.py"))


@pytest.mark.xfail(raises=KnownGap, strict=True, reason="param.grad is None inside a window at stage 3")
def test_sync_script_at_stage_3(tmp_path):
    _known(_launch(tmp_path, 3, "test_sync.py"), "test_gradient_accumulation_with_opt_and_scheduler",
           "must be Tensor, not NoneType")


def test_script_process_and_custom_sampler_checks_at_stage_3(tmp_path):
    functions = ("process_execution_check", "custom_sampler_check")
    _passed(_launch(tmp_path, 3, "test_script.py", *functions), *functions)


def test_script_training_check_at_stage_0(tmp_path):
    """The loader's own ``torch.Generator`` (and Accelerate's ``SeedableRandomSampler`` over it) decides
    the shuffle: the ranks' batches together are a single process's batches, so the trained scalars
    equal the single-process run's."""
    functions = ("training_check", "training_check:use_seedable_sampler=True")
    _passed(_launch(tmp_path, 0, "test_script.py", *functions), *functions)


@pytest.mark.xfail(raises=KnownGap, strict=True, reason="unwrap_model parameters hold this rank's rows at stage 3")
def test_script_training_check_at_stage_3(tmp_path):
    _known(_launch(tmp_path, 3, "test_script.py", "training_check"), "Did not obtain the same model",
           "torch.Size([]) != torch.Size([1])")


def test_metrics_script_at_stage_3(tmp_path):
    """``gather_for_metrics`` drops the samples that even batches repeated, with split and dispatched batches
    (the script imports datasets and evaluate; on the CPU it downloads nothing)."""
    _passed(_launch(tmp_path, 3, "external_deps/test_metrics.py"))


@pytest.mark.xfail(run=False, strict=True, reason="downloads bert-base-cased, GLUE MRPC and the glue metric from the "
                   "Hub (measured: OSError, could not connect to the Hub) and trains bert-base for 2 epochs")
def test_checkpointing_script_at_stage_3(tmp_path):
    _passed(_launch(tmp_path, 3, "external_deps/test_checkpointing.py"))
