"""The users' scripts on one real torch_xla (XLA:CPU) device, through their own entry points.

- examples/minimal.py (optimizer built before ``prepare``, as it may be), started by ``xshard launch``
  as docs/backends.md says: on one XLA device it learns exactly as on the CPU backend (the Parameters
  replaced on the device are rebound in the optimizer).
- examples/qwen_finetune/finetune_loop.py, whose collator pads each batch to its own longest sequence:
  the Accelerator pads token batches to a multiple of 64 on XLA (``static_shape_multiple``), so the
  number of compilations stops growing after warm-up; with padding off it grows with every new width.
- the Trainer with the Trainer docs' XLA FSDP arguments.

One device, no collective: a neighbour's load cannot abort a job, so a test may run its jobs side by side.
The two-device scripts are in test_xla_users_scripts_two_devices.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.side_by_side import side_by_side
from support.xla_scripts import XLA_ENV, epoch_losses, run_script

pytestmark = pytest.mark.xla


def _launch(nproc: int, env: dict[str, str]) -> list[float]:
    cmd = [sys.executable, "-m", "xshard", "launch", "--nproc", str(nproc), "examples/minimal.py",
           "--epochs", "3", "--samples", "256"]
    return epoch_losses(run_script(cmd, env))


def test_minimal_example_learns_the_same_on_one_xla_device_as_on_cpu() -> None:
    pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    on_xla, on_cpu = side_by_side(lambda: _launch(1, XLA_ENV), lambda: _launch(1, {"XSHARD_BACKEND": "cpu"}))
    assert len(on_xla) == len(on_cpu) == 3
    assert on_xla[-1] < 0.5 * on_xla[0], f"no learning on XLA: {on_xla}"
    for a, b in zip(on_xla, on_cpu, strict=True):
        assert abs(a - b) <= 1e-3, (on_xla, on_cpu)


def _compiles(tmp_path: Path, steps: int, multiple: int) -> list[int]:
    pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    out = run_script([sys.executable, "tests/support/xla_compiles_run.py", "--output_dir",
                      str(tmp_path / str(multiple)), "--max_steps", str(steps), "--per_device_train_batch_size", "2",
                      "--model_max_length", "128", "--learning_rate", "1e-3", "--logging_steps", "4",
                      "--save_strategy", "no"], {**XLA_ENV, "XSHARD_STATIC_SHAPE_MULTIPLE": str(multiple)})
    return json.loads(out.strip().splitlines()[-1])["compiles"]


def test_qwen_example_compilations_stay_flat_after_warm_up(tmp_path: Path) -> None:
    padded = _compiles(tmp_path, 12, 64)
    assert len(padded) == 12
    assert padded[7] == padded[-1], f"still compiling after warm-up: {padded}"
    unpadded = _compiles(tmp_path, 8, 0)  # what the padding prevents: a new graph per new width
    assert unpadded[-1] > unpadded[3] and unpadded[-1] > padded[7], (unpadded, padded)


def _rebind_run(pass_optimizer: bool) -> str:
    """A script whose optimizer is built before prepare; passed to prepare or not."""
    return (
        "import torch, xshard\n"
        "from xshard.runtime.rebind import StaleParameterError\n"
        "acc = xshard.Accelerator(seed=0, stage=3)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        + ("model, opt = acc.prepare(model, opt)\n" if pass_optimizer else "model = acc.prepare(model)\n")
        + "before = [p.detach().cpu().clone() for p in model.parameters()]\n"
        "acc.backward(model(torch.randn(8, 4, device=acc.device)).pow(2).mean())\n"
        "try:\n"
        "    opt.step()\n"
        "except StaleParameterError as exc:\n"
        "    print('REFUSED', exc)\n"
        "else:\n"
        "    changed = any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, model.parameters()))\n"
        "    print('CHANGED' if changed else 'UNCHANGED')\n"
    )


def test_an_optimizer_built_before_prepare_trains_the_device_parameters_or_is_refused() -> None:
    pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    assert "CHANGED" in run_script([sys.executable, "-c", _rebind_run(True)], XLA_ENV)
    refused = run_script([sys.executable, "-c", _rebind_run(False)], XLA_ENV)
    assert "REFUSED" in refused and "accelerator.prepare(model, optimizer)" in refused


def _trainer_losses(model: Path, out: Path, backend_args: list[str], env: dict[str, str]) -> list[float]:
    """tests/support/trainer_sft_script.py (an ordinary Trainer SFT script on xshard's Trainer) under `xshard launch`,
    one process; the per-step losses its trainer_state.json records."""
    run_script([sys.executable, "-m", "xshard", "launch", "tests/support/trainer_sft_script.py",
                "--model_name_or_path", str(model), "--data_path", "examples/qwen_finetune/data/alpaca_synthetic.json",
                "--max_records", "32", "--model_max_length", "96", "--output_dir", str(out), "--max_steps", "6",
                "--per_device_train_batch_size", "2", "--logging_steps", "1", "--save_steps", "6", "--report_to", "none",
                # the Trainer's default on torch >= 2.8 is the fused AdamW, which has no XLA kernel (stock or xshard)
                "--optim", "adamw_torch", *backend_args], env)
    history = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_the_trainer_with_an_xla_fsdp_config_trains_as_on_the_cpu(tmp_path: Path, tiny_model: Path) -> None:
    """The Trainer docs' TPU arguments, `--fsdp full_shard --fsdp_config '{"xla": true, "xla_fsdp_grad_ckpt":
    true}'`, on one XLA:CPU device: the stock Trainer would refuse `--fsdp` outside its own XLA FSDP; xshard's
    runs it at stage 3 with activation checkpointing and logs the CPU backend's losses for the same command."""
    pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")
    fsdp_config = tmp_path / "xla_fsdp.json"
    fsdp_config.write_text(json.dumps({"xla": True, "xla_fsdp_grad_ckpt": True}))
    on_xla, on_cpu = side_by_side(  # one device, no collective: a neighbour's load cannot abort it
        lambda: _trainer_losses(tiny_model, tmp_path / "xla", ["--fsdp", "full_shard", "--fsdp_config",
                                                               str(fsdp_config)], XLA_ENV),
        lambda: _trainer_losses(tiny_model, tmp_path / "cpu", [], {"XSHARD_BACKEND": "cpu"}))
    assert len(on_xla) == len(on_cpu) == 6
    for a, b in zip(on_xla, on_cpu, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (on_xla, on_cpu)
    assert (tmp_path / "xla" / "model.safetensors").is_file()  # save_model at the end of the script


