"""A tiny, random, offline Qwen2 model and a Qwen-style tokenizer, for demos and tests.

No model hub is needed: the tokenizer is a byte-level BPE trained in about a second on the
example's own data with Qwen's pre-tokenizer regex and Qwen's special tokens (``<|endoftext|>``
is both EOS and padding, as in Qwen1.5), and the model is a ``Qwen2ForCausalLM`` with a
64-wide hidden state and random weights from a fixed seed. Both are deterministic.

    python tiny.py --output_dir ./tiny-qwen      # then: finetune.py --model_name_or_path ./tiny-qwen

Like Qwen (151,646 tokens, 151,936 embedding rows), the embedding is the tokenizer's size rounded
up to a multiple of 64, never smaller than the tokenizer.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "data" / "alpaca_synthetic.json"

# Qwen2's pre-tokenizer (the split before byte-level BPE), as in its tokenizer.json.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
EMBEDDING_MULTIPLE = 64


def training_texts(data_path: str | Path = DEFAULT_DATA) -> list[str]:
    """The texts the tokenizer learns from: every record's full Alpaca prompt and its response."""
    from data import build_prompt, load_records  # the example's own module (same folder)

    return [build_prompt(r) + r["output"] for r in load_records(data_path)]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a Qwen-style byte-level BPE on ``texts``; returns a transformers fast tokenizer.

    Special tokens are added after training, so (as in Qwen) they take the highest ids.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT,
                                   additional_special_tokens=[IM_START, IM_END], model_max_length=512,
                                   padding_side="right")


def embedding_rows(num_tokens: int) -> int:
    """Embedding rows for a tokenizer of ``num_tokens``: rounded up to a multiple of 64, never fewer."""
    return -(-num_tokens // EMBEDDING_MULTIPLE) * EMBEDDING_MULTIPLE


def build_model(tokenizer, seed: int = 0, hidden_size: int = 64, num_layers: int = 2):
    """A random ``Qwen2ForCausalLM`` sized for ``tokenizer`` (4 heads, 2 KV heads: GQA, untied head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=embedding_rows(len(tokenizer)), hidden_size=hidden_size, intermediate_size=172,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False, use_sliding_window=False,
        # No pad_token_id, as in Qwen1.5's config: a padding_idx would zero the gradient of the EOS
        # embedding row, because the tokenizer pads with the EOS token.
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
    )
    config._attn_implementation = "eager"  # deterministic on CPU, same numerics on every backend
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def build_tiny_qwen(data_path: str | Path = DEFAULT_DATA, vocab_size: int = 512, seed: int = 0):
    """(model, tokenizer): the tokenizer trained on ``data_path``, the model sized for it."""
    tokenizer = build_tokenizer(training_texts(data_path), vocab_size=vocab_size)
    return build_model(tokenizer, seed=seed), tokenizer


def save_tiny_qwen(output_dir: str | Path, data_path: str | Path = DEFAULT_DATA, seed: int = 0) -> Path:
    """Write the tiny model and tokenizer as a Hugging Face folder that ``from_pretrained`` loads offline."""
    model, tokenizer = build_tiny_qwen(data_path, seed=seed)
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: write the tiny model folder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="folder to write the model and tokenizer to")
    parser.add_argument("--data_path", default=str(DEFAULT_DATA), help="Alpaca records to train the tokenizer on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = save_tiny_qwen(args.output_dir, args.data_path, args.seed)
    config = json.loads((out / "config.json").read_text())
    print(f"wrote a tiny Qwen2 ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
