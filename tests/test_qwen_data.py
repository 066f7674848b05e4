"""The Alpaca SFT data recipe of examples/qwen_finetune on the Qwen-style tokenizer: masks, truncation, padding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen_finetune"
sys.path.insert(0, str(EXAMPLE))
import data as alpaca  # noqa: E402
import tiny  # noqa: E402

assert Path(alpaca.__file__).parent == EXAMPLE, "another module named 'data' shadows the example's data.py"

WITH_INPUT = {"instruction": "Sort the numbers in ascending order.", "input": "5, 2, 9", "output": "2, 5, 9"}
NO_INPUT = {"instruction": "What is the capital of Zorvania?", "input": "", "output": "The capital of Zorvania is Quel."}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(tiny.training_texts())


@pytest.fixture(scope="module")
def records():
    return alpaca.load_records(tiny.DEFAULT_DATA)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_prompt_templates_are_the_alpaca_ones():
    with_input = alpaca.build_prompt(WITH_INPUT)
    assert with_input.startswith("Below is an instruction that describes a task, paired with an input that provides "
                                 "further context. Write a response that appropriately completes the request.\n\n")
    assert with_input.endswith("### Instruction:\nSort the numbers in ascending order.\n\n### Input:\n5, 2, 9\n\n"
                               "### Response:")
    no_input = alpaca.build_prompt(NO_INPUT)
    assert no_input == ("Below is an instruction that describes a task. Write a response that appropriately completes "
                        "the request.\n\n### Instruction:\nWhat is the capital of Zorvania?\n\n### Response:")
    # a missing "input" key selects the template without input too
    assert alpaca.build_prompt({"instruction": NO_INPUT["instruction"], "output": "x"}) == no_input


@pytest.mark.parametrize("record", [WITH_INPUT, NO_INPUT], ids=["with_input", "no_input"])
def test_labels_mask_exactly_the_prompt(tokenizer, record):
    prompt_ids = ids(tokenizer, alpaca.build_prompt(record))
    response_ids = ids(tokenizer, record["output"])
    example = alpaca.encode_record(record, tokenizer, model_max_length=512)
    eos = tokenizer.eos_token_id
    assert example["input_ids"] == prompt_ids + response_ids + [eos]
    assert len(example["labels"]) == len(example["input_ids"])
    for position, (token, label) in enumerate(zip(example["input_ids"], example["labels"], strict=True)):
        if position < len(prompt_ids):
            assert label == alpaca.IGNORE_INDEX, f"prompt token {position} is learned"
        else:
            assert label == token, f"response token {position} is masked"
    assert example["labels"][-1] == eos  # the real EOS is learned
    assert tokenizer.decode(example["input_ids"][: len(prompt_ids)]) == alpaca.build_prompt(record)
    learned = [t for t in example["labels"] if t != alpaca.IGNORE_INDEX]
    assert tokenizer.decode(learned) == record["output"] + "<|endoftext|>"


def test_boundary_is_exact_where_joined_tokenization_is_not(tokenizer, records):
    """Qwen's pre-tokenizer glues ':' to the response ("Response:The"), so masking len(tok(prompt)) tokens of
    tok(prompt + response) is off at the boundary for some records; separate tokenization never is."""
    shifted = 0
    for record in records:
        prompt = alpaca.build_prompt(record)
        joined = ids(tokenizer, prompt + record["output"])
        naive_prompt = tokenizer.decode(joined[: len(ids(tokenizer, prompt))])
        shifted += naive_prompt != prompt
        example = alpaca.encode_record(record, tokenizer, 512)
        n_masked = example["labels"].count(alpaca.IGNORE_INDEX)
        assert tokenizer.decode(example["input_ids"][:n_masked]) == prompt
    assert shifted > 0, "the tokenizer no longer reproduces Qwen's boundary pitfall; the check above proves less"


def test_truncation_cuts_the_response_and_keeps_labels_aligned(tokenizer):
    full = alpaca.encode_record(WITH_INPUT, tokenizer, 512)
    n_prompt = full["labels"].count(alpaca.IGNORE_INDEX)
    limit = n_prompt + 2
    cut = alpaca.encode_record(WITH_INPUT, tokenizer, limit)
    assert cut["input_ids"] == full["input_ids"][:limit]
    assert cut["labels"] == [alpaca.IGNORE_INDEX] * n_prompt + full["input_ids"][n_prompt:limit]


def test_dataset_drops_records_with_nothing_to_learn(tokenizer):
    n_prompt = len(ids(tokenizer, alpaca.build_prompt(WITH_INPUT)))
    short_prompt = len(ids(tokenizer, alpaca.build_prompt(NO_INPUT)))
    assert short_prompt < n_prompt
    dataset = alpaca.SupervisedDataset([WITH_INPUT, NO_INPUT], tokenizer, model_max_length=n_prompt)
    assert (len(dataset), dataset.dropped) == (1, 1)
    assert dataset[0] == alpaca.encode_record(NO_INPUT, tokenizer, n_prompt)
    with pytest.raises(alpaca.AlpacaDataError, match="raise --model_max_length"):
        alpaca.SupervisedDataset([WITH_INPUT], tokenizer, model_max_length=n_prompt)


def test_collator_pads_right_and_never_masks_the_real_eos(tokenizer):
    """pad == eos (Qwen): padding is -100 and attention 0, the real EOS keeps its label and attention."""
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    examples = [alpaca.encode_record(r, tokenizer, 512) for r in (WITH_INPUT, NO_INPUT)]
    lengths = [len(e["input_ids"]) for e in examples]
    batch = alpaca.SupervisedCollator(tokenizer.pad_token_id)(examples)
    width = max(lengths)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (2, width) for k in batch}
    for row, (example, length) in enumerate(zip(examples, lengths, strict=True)):
        assert batch["input_ids"][row, :length].tolist() == example["input_ids"]
        assert batch["labels"][row, :length].tolist() == example["labels"]
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (width - length)
        assert batch["input_ids"][row, length:].eq(tokenizer.pad_token_id).all()
        assert batch["labels"][row, length:].eq(alpaca.IGNORE_INDEX).all()
        assert batch["labels"][row, length - 1] == tokenizer.eos_token_id
        assert batch["attention_mask"][row, length - 1] == 1
    # the classic `input_ids != pad_token_id` mask would hide the real EOS here
    naive = batch["input_ids"].ne(tokenizer.pad_token_id).long()
    assert not torch.equal(naive, batch["attention_mask"])


def test_collator_pad_to_multiple_of(tokenizer):
    example = alpaca.encode_record(NO_INPUT, tokenizer, 512)
    batch = alpaca.SupervisedCollator(tokenizer.pad_token_id, pad_to_multiple_of=64)([example])
    assert batch["input_ids"].shape[1] % 64 == 0
    assert batch["attention_mask"].sum() == len(example["input_ids"])


def test_padding_does_not_change_the_loss(tokenizer):
    """A padded batch gives the same loss as the unpadded example: padding is invisible to training."""
    model = tiny.build_model(tokenizer).eval()
    example = alpaca.encode_record(WITH_INPUT, tokenizer, 512)
    alone = alpaca.SupervisedCollator(tokenizer.pad_token_id)([example])
    padded = alpaca.SupervisedCollator(tokenizer.pad_token_id, pad_to_multiple_of=256)([example])
    assert padded["input_ids"].shape[1] > alone["input_ids"].shape[1]
    with torch.no_grad():
        loss_alone = model(**alone).loss
        loss_padded = model(**padded).loss
    torch.testing.assert_close(loss_padded, loss_alone, rtol=1e-5, atol=1e-6)


def test_load_records_errors_name_the_fix(tmp_path):
    with pytest.raises(alpaca.AlpacaDataError, match="no such file"):
        alpaca.load_records(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "x", "input": ""}]))
    with pytest.raises(alpaca.AlpacaDataError, match="record 0: missing key 'output'"):
        alpaca.load_records(bad)
    bad.write_text(json.dumps({"instruction": "x", "output": "y"}))
    with pytest.raises(alpaca.AlpacaDataError, match="non-empty JSON list"):
        alpaca.load_records(bad)
    bad.write_text(json.dumps([{"instruction": "x", "output": 3}]))
    with pytest.raises(alpaca.AlpacaDataError, match="'output' must be a string"):
        alpaca.load_records(bad)
    bad.write_text("[{")
    with pytest.raises(alpaca.AlpacaDataError, match="not valid JSON"):
        alpaca.load_records(bad)


def test_jsonl_records(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (WITH_INPUT, NO_INPUT)) + "\n")
    assert alpaca.load_records(path) == [WITH_INPUT, NO_INPUT]


def test_prepare_tokenizer_adds_no_tokens(tokenizer):
    before = len(tokenizer)
    alpaca.prepare_tokenizer(tokenizer, 256)
    assert len(tokenizer) == before and tokenizer.model_max_length == 256
    assert tokenizer.pad_token == "<|endoftext|>"


def test_check_vocab_fits(tokenizer):
    model = tiny.build_model(tokenizer)
    alpaca.check_vocab_fits(tokenizer, model)  # a larger embedding is fine and left alone
    assert model.get_input_embeddings().num_embeddings > len(tokenizer)
    model.resize_token_embeddings(len(tokenizer) - 1)
    with pytest.raises(alpaca.AlpacaDataError, match="embedding has .* rows"):
        alpaca.check_vocab_fits(tokenizer, model)
