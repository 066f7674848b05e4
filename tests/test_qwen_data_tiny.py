"""The tiny offline Qwen2 model and Qwen-style tokenizer of examples/qwen_finetune."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen_finetune"
sys.path.insert(0, str(EXAMPLE))
import data as alpaca  # noqa: E402
import tiny  # noqa: E402

FINGERPRINT = """
import hashlib, sys
sys.path.insert(0, sys.argv[1])
import tiny
model, tok = tiny.build_tiny_qwen()
h = hashlib.sha256(tok.backend_tokenizer.to_str().encode())
for name, tensor in sorted(model.state_dict().items()):
    h.update(name.encode()); h.update(tensor.numpy().tobytes())
print(h.hexdigest())
"""


def fingerprint(model, tokenizer) -> str:
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny_qwen():
    return tiny.build_tiny_qwen()


def test_same_model_and_tokenizer_in_another_process(tiny_qwen):
    """Every rank of a job builds the tiny model itself: it must be bit-identical across processes."""
    again = tiny.build_tiny_qwen()
    assert fingerprint(*again) == fingerprint(*tiny_qwen)
    out = subprocess.run([sys.executable, "-c", FINGERPRINT, str(EXAMPLE)], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == fingerprint(*tiny_qwen)


def test_seed_changes_the_weights(tiny_qwen):
    model, tokenizer = tiny_qwen
    other = tiny.build_model(tokenizer, seed=1)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_tokenizer_is_qwen_style(tiny_qwen):
    _, tok = tiny_qwen
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    special = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert special == [len(tok) - 3, len(tok) - 2, len(tok) - 1]  # after the BPE vocabulary, as in Qwen
    # Qwen's pre-tokenizer: punctuation joins the letters after it; byte-level, so any text round-trips
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("### Response:The answer")]
    assert pieces == ["###", "ĠResponse", ":The", "Ġanswer"]
    text = "Ünïcode ✓ 数据 <|im_start|>"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok("a", add_special_tokens=True)["input_ids"] == tok("a", add_special_tokens=False)["input_ids"]


def test_vocab_sizes_are_consistent(tiny_qwen):
    model, tok = tiny_qwen
    rows = model.get_input_embeddings().num_embeddings
    assert model.config.vocab_size == rows == model.lm_head.out_features
    assert rows >= len(tok) and rows % 64 == 0 and rows - len(tok) < 64
    assert model.config.eos_token_id == tok.eos_token_id == tok.pad_token_id
    # like Qwen1.5: no padding_idx, which would freeze the EOS embedding row (pad == eos)
    assert model.config.pad_token_id is None and model.get_input_embeddings().padding_idx is None
    records = alpaca.load_records(tiny.DEFAULT_DATA)
    encoded = [alpaca.encode_record(r, tok, 512) for r in records]
    assert max(max(e["input_ids"]) for e in encoded) < rows


def test_model_shape_and_speed_class(tiny_qwen):
    model, _ = tiny_qwen
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert config.num_key_value_heads < config.num_attention_heads  # GQA exercised
    assert set(model._no_split_modules) == {"Qwen2DecoderLayer"}
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_saved_folder_loads_offline(tmp_path, tiny_qwen, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tiny.save_tiny_qwen(tmp_path / "tiny-qwen")
    model, tok = tiny_qwen
    loaded_tok = AutoTokenizer.from_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    text = alpaca.build_prompt({"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"})
    assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded_tok.pad_token_id == loaded_tok.eos_token_id == tok.eos_token_id
    batch = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, model.eval()(batch).logits)


def test_loss_falls_on_the_synthetic_data(tiny_qwen):
    """The shipped data is learnable: a few Adam steps on a fixed batch cut the loss."""
    model, tok = tiny_qwen
    model = tiny.build_model(tok)  # a fresh copy, the fixture's stays untouched
    records = alpaca.load_records(tiny.DEFAULT_DATA)[:16]
    batch = alpaca.SupervisedCollator(tok.pad_token_id)([alpaca.encode_record(r, tok, 512) for r in records])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    losses = []
    for _ in range(25):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(model.config.vocab_size))).item(), rel=0.1)
    assert losses[-1] < 0.5 * losses[0]
