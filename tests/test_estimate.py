"""xshard estimate: parameter counts, the ZeRO paper's per-device model states, activations, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xshard.cli import main as xshard_main
from xshard.estimate import (
    GB,
    PRECISIONS,
    EstimateError,
    activation_bytes,
    estimate_memory,
    load_model_size,
    model_size_from_config,
    model_state_bytes,
    parse_memory,
    parse_stage,
)

CONFIGS = Path(__file__).resolve().parent / "data" / "estimate"
QWEN15_7B = CONFIGS / "qwen1.5-7b-chat.config.json"


def config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


# ---- parameter counts ------------------------------------------------------------------------------------------

def test_qwen15_7b_matches_the_published_size():
    size = load_model_size(QWEN15_7B)
    assert size.total_params == pytest.approx(7.7e9, rel=0.01)  # model card: 7.7B
    assert size.total_params == pytest.approx(7.72e9, rel=0.001)  # reference notes: 7.72B
    embeddings_and_head = size.root_params - size.hidden_size  # minus the final norm
    assert embeddings_and_head == pytest.approx(1.245e9, rel=0.001)
    assert size.num_layers * size.largest_layer_params + size.root_params == size.total_params


@pytest.mark.parametrize(("name", "published", "rel"), [
    ("llama-2-7b.config.json", 6.74e9, 0.001),   # Llama 2 7B: 6.74B
    ("qwen2-7b.config.json", 7.62e9, 0.001),     # Qwen2-7B: 7.62B (GQA: 4 KV heads)
    ("qwen3-0.6b.config.json", 0.6e9, 0.01),     # Qwen3-0.6B: 0.6B (tied head, per-head q/k norms)
])
def test_published_sizes(name, published, rel):
    assert model_size_from_config(config(name)).total_params == pytest.approx(published, rel=rel)


def test_qwen3_non_embedding_size():
    size = model_size_from_config(config("qwen3-0.6b.config.json"))
    assert size.total_params - size.vocab_size * size.hidden_size == pytest.approx(0.44e9, rel=0.01)


def _tiny_hf_models():
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=200, hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6)
    return {
        "qwen2_gqa": (Qwen2ForCausalLM, Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False)),
        "qwen2_tied": (Qwen2ForCausalLM, Qwen2Config(**common, num_key_value_heads=6, tie_word_embeddings=True)),
        "llama_bias": (LlamaForCausalLM, LlamaConfig(**common, num_key_value_heads=3, attention_bias=True,
                                                     mlp_bias=True, tie_word_embeddings=False)),
        "qwen3_head_dim": (Qwen3ForCausalLM, Qwen3Config(**common, num_key_value_heads=2, head_dim=16,
                                                         tie_word_embeddings=True)),
    }


@pytest.fixture(scope="module", params=["qwen2_gqa", "qwen2_tied", "llama_bias", "qwen3_head_dim"])
def hf_model(request):
    cls, cfg = _tiny_hf_models()[request.param]
    return cls(cfg)


def test_config_count_equals_the_real_modules(hf_model):
    """The formula against transformers' own modules: every variant (GQA, biases, tied head, q/k norms)."""
    size = model_size_from_config(hf_model.config.to_dict())
    assert size.total_params == sum(p.numel() for p in hf_model.parameters())
    layer = hf_model.model.layers[0]
    assert size.largest_layer_params == sum(p.numel() for p in layer.parameters())


def test_safetensors_headers_count_without_loading(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    size = load_model_size(tmp_path)
    assert size.source == "safetensors headers"
    assert size.total_params == sum(p.numel() for p in hf_model.parameters())
    assert size.largest_layer_params == sum(p.numel() for p in hf_model.model.layers[0].parameters())


def test_sharded_safetensors_index(tmp_path):
    cls, cfg = _tiny_hf_models()["qwen2_gqa"]
    model = cls(cfg)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    assert load_model_size(tmp_path).total_params == sum(p.numel() for p in model.parameters())
    shards[1].unlink()
    with pytest.raises(EstimateError, match=f"names shards that are not in the folder: {shards[1].name}"):
        load_model_size(tmp_path)


def test_model_input_errors(tmp_path):
    with pytest.raises(EstimateError, match="no such file or folder"):
        load_model_size(tmp_path / "nowhere")
    with pytest.raises(EstimateError, match="the folder has no config.json"):
        load_model_size(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    with pytest.raises(EstimateError, match="model_type 'gpt2' is not a decoder .*safetensors"):
        load_model_size(bad)
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(EstimateError, match="missing integer 'num_attention_heads'"):
        load_model_size(bad)
    bad.write_text("{not json")
    with pytest.raises(EstimateError, match="not valid JSON"):
        load_model_size(bad)
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    bad.write_text(QWEN15_7B.read_text())
    with pytest.raises(EstimateError, match="not a readable .safetensors file"):
        load_model_size(tmp_path)


# ---- model states: the ZeRO paper ------------------------------------------------------------------------------

def test_zero_paper_worked_example():
    """ZeRO paper, figure 1: 7.5B parameters, N=64, K=12 -> 120 / 31.4 / 16.6 / 1.9 GB per device."""
    totals = [sum(model_state_bytes(7.5e9, 64, stage, PRECISIONS["bf16"])) / GB for stage in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize(("stage", "bytes_per_parameter"), [(0, 16), (1, 4 + 4 + 8 / 8), (2, 4 + 12 / 8), (3, 16 / 8)])
def test_fp32_training_is_16_bytes_per_parameter(stage, bytes_per_parameter):
    """fp32 parameters and gradients, Adam's two fp32 moments, no master copy; N = 8."""
    assert sum(model_state_bytes(1e9, 8, stage, PRECISIONS["fp32"])) == pytest.approx(bytes_per_parameter * 1e9)


def test_offload_moves_states_to_the_host():
    size = load_model_size(QWEN15_7B)
    psi = size.total_params
    kept = estimate_memory(size, 8, 3)
    moved = estimate_memory(size, 8, 3, offload=True)
    assert moved.host == pytest.approx(16 * psi / 8)
    assert (moved.params, moved.grads, moved.optimizer) == (0, 0, 0)
    assert kept.total - moved.total == pytest.approx(16 * psi / 8)
    stage1 = estimate_memory(size, 8, 1, offload=True)
    assert stage1.host == pytest.approx(12 * psi / 8) and stage1.grads == pytest.approx(2 * psi)
    with pytest.raises(EstimateError, match="--offload needs stage 1, 2 or 3"):
        estimate_memory(size, 8, 0, offload=True)


def test_stage3_transients_are_the_gathered_units():
    size = load_model_size(QWEN15_7B)
    stage2, stage3 = estimate_memory(size, 8, 2), estimate_memory(size, 8, 3)
    unit_grads = 2 * (size.root_params + size.largest_layer_params)
    assert stage2.gathered == pytest.approx(unit_grads)
    assert stage3.gathered == pytest.approx(unit_grads + 2 * (size.root_params + 2 * size.largest_layer_params))
    assert estimate_memory(size, 8, 1).gathered == 0


# ---- activations -------------------------------------------------------------------------------------------------

def test_activation_terms():
    size = load_model_size(QWEN15_7B)
    bf16 = PRECISIONS["bf16"]
    base = activation_bytes(size, 1, 2048, bf16)
    assert activation_bytes(size, 2, 2048, bf16) == pytest.approx(2 * base)
    scores = size.num_layers * size.num_heads * 2048**2 * (4 + 2)
    assert activation_bytes(size, 1, 2048, bf16, attention="eager") - base == pytest.approx(scores)
    checkpointed = activation_bytes(size, 1, 2048, bf16, grad_ckpt=True)
    assert checkpointed < base / 3
    # per layer and token, a Qwen1.5-7B layer keeps 37.5 h bytes: close to the Megatron paper's 34 h for GPT
    head = 2048 * (2 * 4096 * 2 + size.vocab_size * 10)
    assert (base - head) / (2048 * size.num_layers * 4096) == pytest.approx(37.5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_activations_match_what_autograd_keeps(attention, grad_ckpt):
    """Sum the tensors autograd saves in a real Qwen2 forward (fp32, CPU) and compare with the estimate."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    values = dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**values, attn_implementation=attention, use_cache=False)).train()
    if grad_ckpt:
        # newer transformers rename gradient_checkpointing_enable (kept, deprecated) to activation_checkpointing_enable
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    batch, seq = 2, 256
    tokens = torch.randint(0, 512, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=tokens, labels=tokens)
    measured = sum(saved.values()) + out.logits.numel() * out.logits.element_size()  # saved + the returned logits
    size = model_size_from_config({"model_type": "qwen2", **values})
    estimate = activation_bytes(size, batch, seq, PRECISIONS["fp32"], grad_ckpt, attention)
    if grad_ckpt:  # the forward keeps the layer inputs; one layer's activations return while it is recomputed
        fp32 = PRECISIONS["fp32"]
        head = activation_bytes(dataclasses.replace(size, num_layers=0), batch, seq, fp32, False, attention)
        one_layer = (activation_bytes(size, batch, seq, fp32, False, attention) - head) / size.num_layers
        estimate -= one_layer
    assert estimate == pytest.approx(measured, rel=0.2)


# ---- parsing and the command line ------------------------------------------------------------------------------

def test_parse_memory_and_stage():
    assert parse_memory("64GB") == 64 * 10**9
    assert parse_memory("64 GiB") == 64 * 2**30
    assert parse_memory("80000mb") == 80 * 10**9
    assert parse_memory("1024") == 1024
    for bad in ("64 parsecs", "GB", "64G", ""):
        with pytest.raises(EstimateError, match="is not a size; write e.g. 64GB"):
            parse_memory(bad)
    assert [parse_stage(s) for s in ("0", "3", "full_shard", "SHARD_GRAD_OP", "NO_SHARD")] == [0, 3, 3, 2, 0]
    with pytest.raises(EstimateError, match="is not valid: use one of 0, 1, 2, 3 or"):
        parse_stage("4")


def test_cli_json_matches_the_api(capsys):
    rc = xshard_main(["estimate", "--model", str(QWEN15_7B), "--nproc", "8", "--stage", "3", "--device-memory",
                      "64GB", "--grad-ckpt", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    size = load_model_size(QWEN15_7B)
    expected = estimate_memory(size, 8, 3, grad_ckpt=True, device_memory=64 * 10**9)
    [got] = report["estimates"]
    assert got["total"] == round(expected.total) and got["fits"] is True and got["stage"] == 3
    assert report["model"]["total_params"] == size.total_params
    assert report["settings"]["nproc"] == 8 and report["settings"]["grad_ckpt"] is True


def test_cli_table_shows_every_stage_and_the_verdict(capsys):
    rc = xshard_main(["estimate", "--model", str(QWEN15_7B), "--nproc", "8", "--device-memory", "64GB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "7.72B parameters" in out and "stage 0" in out and "stage 3" in out
    fits = next(line for line in out.splitlines() if line.startswith("fits 64.0 GB")).split()[3:]
    assert fits == ["no", "yes", "yes", "yes"]


def test_cli_exit_status_when_it_does_not_fit(capsys):
    rc = xshard_main(["estimate", "--model", str(QWEN15_7B), "--nproc", "8", "--stage", "0", "--device-memory",
                      "64GB"])
    assert rc == 1 and "no" in capsys.readouterr().out.splitlines()[-2]


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "missing.json"], "--model missing.json: no such file or folder"),
    (["--model", str(QWEN15_7B), "--stage", "5"], "argument --stage: stage='5' is not valid: use one of 0, 1, 2, 3"),
    (["--model", str(QWEN15_7B), "--device-memory", "lots"], "device memory 'lots' is not a size"),
    (["--model", str(QWEN15_7B), "--nproc", "0"], "--nproc must be at least 1"),
    (["--model", str(QWEN15_7B), "--stage", "0", "--offload"], "--offload needs stage 1, 2 or 3"),
])
def test_cli_bad_input_is_a_clear_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(xshard_main(["estimate", *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "xshard", "estimate", "--model", str(QWEN15_7B), "--nproc", "8",
                          "--stage", "FULL_SHARD", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["estimates"][0]["stage"] == 3


def test_cli_on_a_small_model_folder_uses_megabytes(tmp_path, capsys):
    cls, cfg = _tiny_hf_models()["qwen2_gqa"]
    model = cls(cfg)
    model.save_pretrained(tmp_path)
    assert xshard_main(["estimate", "--model", str(tmp_path), "--nproc", "2", "--stage", "3", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in model.parameters())
    assert f"({n:,}; from safetensors headers)" in out
    params_row = next(line for line in out.splitlines() if line.startswith("parameters"))
    assert out.splitlines()[3].startswith("MB (10^6 bytes)")
    assert float(params_row.split()[1]) == pytest.approx(4 * n / 2 / 1e6, abs=0.01)
