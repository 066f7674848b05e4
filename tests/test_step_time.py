"""The step time predicted before renting the machines (``xshard/step_time.py``, ``xshard estimate --machine``):
the communication volume of each stage, compute against communication, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xshard.estimate import EstimateError, model_size_from_config
from xshard.step_time import COMM_EFFICIENCY, MACHINES, comm_bytes_per_device, predict

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def test_each_stage_sends_the_zero_papers_volume_over_a_ring():
    params, world = 1000, 8
    ring = (world - 1) / world
    assert comm_bytes_per_device(params, 0, world) == pytest.approx(2 * 2 * params * ring)  # all-reduce of bf16 grads
    assert comm_bytes_per_device(params, 2, world) == pytest.approx(2 * 2 * params * ring)  # reduce-scatter + gather
    assert comm_bytes_per_device(params, 3, world) == pytest.approx(3 * 2 * params * ring)  # 2 gathers + reduce
    assert comm_bytes_per_device(params, 3, world, "fp32") == pytest.approx(3 * 4 * params * ring)
    assert comm_bytes_per_device(params, 3, 1) == 0.0


def test_an_8b_model_is_compute_bound_on_an_h100_node_and_communication_bound_across_slow_nodes():
    size = model_size_from_config(LLAMA_8B)
    node = predict(size, 3, 8, MACHINES["h100"], seq_len=8192, mfu=0.4)
    # 6N + 12 L d s, N without the input embedding
    flops = 6 * (size.total_params - 128256 * 4096) + 12 * 32 * 4096 * 8192
    assert node.flops_per_token == flops
    assert node.compute_s == pytest.approx(8192 * flops / (989.4e12 * 0.4))
    assert node.comm_s == pytest.approx(3 * 2 * size.total_params * 7 / 8 / (450e9 * COMM_EFFICIENCY))
    assert node.bound == "compute" and node.step_s == node.compute_s
    assert node.tokens_per_s_per_device == pytest.approx(8192 / node.compute_s)

    across = predict(size, 3, 64, MACHINES["910b"], seq_len=2048, mfu=0.4)  # 8 nodes over 200 Gb/s RoCE
    assert across.comm_s == pytest.approx(3 * 2 * size.total_params * 63 / 64 / (25e9 * COMM_EFFICIENCY))
    assert across.bound == "communication" and across.step_s == across.comm_s


def test_an_impossible_mfu_or_a_dtype_the_device_has_no_peak_for_is_refused():
    size = model_size_from_config(LLAMA_8B)
    with pytest.raises(EstimateError, match="--mfu 1.5"):
        predict(size, 3, 8, MACHINES["h100"], mfu=1.5)
    with pytest.raises(EstimateError, match="TPU v5p has no published fp32 peak; use bf16"):
        predict(size, 3, 8, MACHINES["tpu-v5p"], dtype="fp32")


def test_xshard_estimate_prints_the_step_time_with_its_assumptions(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    cli = [sys.executable, "-m", "xshard", "estimate", "--model", str(config), "--nproc", "64", "--stage", "3",
           "--seq-len", "8192", "--machine", "h100"]
    text = subprocess.run(cli, capture_output=True, text=True, timeout=120, check=True,
                          cwd=Path(__file__).resolve().parent.parent).stdout
    assert "step time on 64 h100 device(s), 8 node(s)" in text and "MFU 0.40 assumed" in text
    assert "tokens/s per device" in text and "bound by" in text
    data = json.loads(subprocess.run([*cli, "--json", "--mfu", "0.3"], capture_output=True, text=True, timeout=120,
                                     check=True).stdout)
    (row,) = data["step_time"]
    assert row["stage"] == 3 and row["bound"] in ("compute", "communication")
    assert row["step_s"] == pytest.approx(max(row["compute_s"], row["comm_s"]))
