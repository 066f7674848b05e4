"""finetune_loop.py and finetune.py (the Trainer script) on the NPU code path, emulated: the fake torch_npu and the test-only "hccl" process group
over gloo (tests/support/fakes/npu.py). Not a test on NPU hardware: the compute tensors stay on the CPU.

The launch line (``XSHARD_BACKEND=npu``, 2 processes) must select the ``npu:<local rank>`` devices,
bind them before the process group starts, start "hccl", probe bf16 support, and run to the end:
in bf16 on a 910B-like chip, in fp32 (with a log line) on a chip without bf16. The fp32 run must train
exactly as the same fine-tune on the CPU backend does: the same losses, gradient norms and final weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
EXAMPLE = TESTS.parent / "examples" / "qwen_finetune"


def _emulated_npu_main() -> None:
    """Rank entry point: install the fake NPU, keep tensors on the CPU, record what was asked, run finetune_loop.py."""
    import contextlib
    import runpy

    import torch
    import torch.distributed as dist

    # transformers asks importlib whether torch_npu exists, which a fake module cannot answer: let it
    # look before the fake is installed (as on a machine where transformers was imported first)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import PreTrainedTokenizerFast  # noqa: F401

    sys.path.insert(0, str(TESTS))
    from support.fakes.npu import install_fake_torch_npu

    calls = install_fake_torch_npu(device_count=2, bf16=os.environ["FAKE_NPU_BF16"] == "1")
    from xshard.backends.devices.npu import NPUBackend

    seen: dict = {"devices": set(), "autocast": set(), "bf16_probes": 0}
    real_device, real_init = NPUBackend.device, NPUBackend.init_process_group
    probe = torch.npu.is_bf16_supported

    def device(self, local_rank=None):
        seen["devices"].add(str(real_device(self, local_rank)))
        return torch.device("cpu")  # the fake NPU has no kernels: compute on the CPU

    def init_process_group(self, timeout=None):
        real_init(self, timeout)
        seen["dist_backend"] = dist.get_backend()

    def autocast(self, dtype=None, enabled=True):
        seen["autocast"].add(str(dtype) if enabled else "off")
        return torch.autocast("cpu", dtype=dtype) if enabled and dtype is not None else contextlib.nullcontext()

    def counting_probe():
        seen["bf16_probes"] += 1
        return probe()

    NPUBackend.device, NPUBackend.init_process_group, NPUBackend.autocast = device, init_process_group, autocast
    # dist.barrier asks torch for the current accelerator; the real torch_npu registers its device hooks
    # for that, the fake cannot: answer "cpu", where the emulated job's tensors are
    torch._C._get_accelerator = lambda: torch.device("cpu")
    torch.npu.is_bf16_supported = counting_probe
    sys.argv = [str(EXAMPLE / os.environ["EMULATED_SCRIPT"]), *sys.argv[1:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    out = Path(os.environ["RECORD_DIR"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps({**seen, "devices": sorted(seen["devices"]), "autocast": sorted(seen["autocast"]),
                               "set_device": calls.set_device}))


#: the fine-tune both runs train: the emulated NPU one (with --bf16 True) and the CPU one it is compared with
ARGS = ["--deepspeed", str(EXAMPLE / "ds_config_zero3.json"), "--max_steps", "3", "--per_device_train_batch_size",
        "2", "--model_max_length", "64", "--learning_rate", "3e-3", "--logging_steps", "1", "--save_strategy", "no",
        "--seed", "7"]


def run_emulated(tmp_path: Path, bf16_chip: bool, script: str = "finetune_loop.py") -> tuple[str, list[dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           *ARGS, "--bf16", "True", "--output_dir", str(tmp_path / "out")]
    if script == "finetune.py":
        # the fake torch_npu registers no device hooks, so torch cannot pin host memory for it (the Trainer pins
        # its loaders' batches wherever torch reports an accelerator; the real torch_npu can)
        cmd += ["--dataloader_pin_memory", "False"]
    env = {**os.environ, "XSHARD_BACKEND": "npu", "FAKE_NPU_BF16": "1" if bf16_chip else "0",
           "RECORD_DIR": str(tmp_path), "OMP_NUM_THREADS": "1", "EMULATED_SCRIPT": script, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> Path:
    """The same fine-tune in fp32 on the CPU backend (gloo), launched the same way: its output folder.

    The emulated NPU run in fp32 must match it exactly: the same CPU kernels compute both (the fake device's
    tensors are CPU tensors, one thread per rank), and what differs, the collectives (the NPU backend's
    native ReduceOp.AVG and native reduce-scatter and all-gather through "hccl", the CPU backend's SUM then
    divide over point-to-point exchanges and broadcasts), gives the same bits on 2 ranks: each element's
    reduction is one addition of two values, which IEEE rounds the same in either order, and a halving,
    which is exact; a gather copies. Measured: no loss, gradient norm or final weight differs in any bit.
    On more than 2 ranks the order of the additions would matter, and a tolerance with it.
    """
    out = tmp_path_factory.mktemp("cpu") / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(EXAMPLE / "finetune_loop.py"), *ARGS, "--output_dir", str(out)]
    env = {**os.environ, "XSHARD_BACKEND": "cpu", "OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.parametrize("bf16_chip", [True, False], ids=["910B-bf16", "910A-no-bf16"])
def test_finetune_runs_on_the_emulated_npu_path(tmp_path, bf16_chip, request):
    output, ranks = run_emulated(tmp_path, bf16_chip)
    for rank, seen in enumerate(ranks):
        assert seen["dist_backend"] == "hccl"
        assert seen["set_device"][0] == rank  # bound before the process group started
        assert seen["devices"] == [f"npu:{rank}"]
        assert seen["bf16_probes"] >= 1
        assert seen["autocast"] == (["torch.bfloat16"] if bf16_chip else ["off"])
    assert ("precision bf16" in output) is bf16_chip
    if not bf16_chip:
        assert "bf16 was asked for, but the npu backend cannot compute in it here: training in fp32" in output
    assert "step 3/3" in output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    if not bf16_chip:  # fp32: the same run as the CPU backend's, bit for bit (see cpu_run)
        from safetensors.torch import load_file
        from torch import equal

        reference = request.getfixturevalue("cpu_run")
        emulated, expected = _log(tmp_path / "out"), _log(reference)
        assert [r["step"] for r in emulated] == [r["step"] for r in expected] == [1, 2, 3]
        assert [r["loss"] for r in emulated] == [r["loss"] for r in expected]
        # the norm before clipping: what shows a wrong gradient scale, which clipping and AdamW hide from the loss
        assert [r["grad_norm"] for r in emulated] == [r["grad_norm"] for r in expected]
        weights, expected_weights = load_file(tmp_path / "out" / "model.safetensors"), load_file(
            reference / "model.safetensors")
        assert sorted(weights) == sorted(expected_weights)
        assert [k for k, v in expected_weights.items() if not equal(weights[k], v)] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("bf16_chip", [True, False], ids=["910B-bf16", "910A-no-bf16"])
def test_the_trainer_script_runs_on_the_emulated_npu_path(tmp_path, bf16_chip):
    output, ranks = run_emulated(tmp_path, bf16_chip, "finetune.py")
    for rank, seen in enumerate(ranks):
        assert seen["dist_backend"] == "hccl"
        assert seen["set_device"][0] == rank  # bound before the process group started
        assert seen["devices"] == [f"npu:{rank}"]
        assert seen["bf16_probes"] >= 1
        assert ("torch.bfloat16" in seen["autocast"]) is bf16_chip
    warning = "--bf16 was asked for, but the npu backend cannot compute in torch.bfloat16"
    assert output.count(warning) == (0 if bf16_chip else 1)  # once, from rank 0
    assert "'train_loss'" in output
    assert (tmp_path / "out" / "model.safetensors").is_file()


if __name__ == "__main__":
    _emulated_npu_main()
