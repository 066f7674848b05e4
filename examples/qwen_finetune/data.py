"""The Alpaca supervised fine-tuning data recipe, made safe for Qwen tokenizers.

Each record ``{"instruction", "input", "output"}`` becomes a prompt (one of the two Stanford
Alpaca templates) and a response. The model learns the response and the end-of-sequence token;
the prompt tokens and the padding get the label -100, which the loss ignores.

Three Qwen pitfalls of the original recipe are avoided on purpose:

1. Prompt/response boundary. Qwen's pre-tokenizer joins punctuation with the letters after it
   (``"### Response:The"`` is one pre-token), so counting the tokens of the prompt alone and masking
   that many tokens of the *joined* string can be off by one. Here prompt and response are tokenized
   separately and the token ids concatenated, so the boundary is exact by construction.
2. pad == eos. Qwen's tokenizer pads with ``<|endoftext|>``, which is also its end-of-sequence
   token. Masks built with ``input_ids != pad_token_id`` would then hide the real EOS the model must
   learn. Here labels and the attention mask are built from the true lengths, never from token values.
3. Vocabulary size. The original recipe adds special tokens and resizes the embeddings to
   ``len(tokenizer)``, which *shrinks* Qwen's 151,936-row embedding to about 151,646 rows.
   Nothing here adds tokens or resizes; :func:`check_vocab_fits` only checks that every token id
   has an embedding row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IGNORE_INDEX = -100

# The two Stanford Alpaca prompt templates, word for word.
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)

REQUIRED_KEYS = ("instruction", "output")


class AlpacaDataError(ValueError):
    """The data file or a record is not in the Alpaca format; the message says what to fix."""


def load_records(path: str | Path) -> list[dict[str, str]]:
    """Read Alpaca records from a JSON list (``alpaca_data.json``) or a JSON-lines file.

    Every record needs ``instruction`` and ``output`` strings; ``input`` is optional (missing or empty
    selects the template without input).
    """
    path = Path(path)
    if not path.is_file():
        raise AlpacaDataError(f"--data_path {path}: no such file (expected an Alpaca-format .json or .jsonl file)")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AlpacaDataError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(records, list) or not records:
        raise AlpacaDataError(f"{path}: expected a non-empty JSON list of records like "
                              '{"instruction": ..., "input": ..., "output": ...}')
    for index, record in enumerate(records):
        _check_record(record, f"{path} record {index}")
    return records


def _check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise AlpacaDataError(f"{where}: expected an object with 'instruction', 'input', 'output', got {type(record).__name__}")
    for key in REQUIRED_KEYS:
        if key not in record:
            raise AlpacaDataError(f"{where}: missing key '{key}' (Alpaca records need 'instruction' and 'output')")
    for key in (*REQUIRED_KEYS, "input"):
        if key in record and not isinstance(record[key], str):
            raise AlpacaDataError(f"{where}: '{key}' must be a string, got {type(record[key]).__name__}")


def build_prompt(record: dict[str, str]) -> str:
    """The Alpaca prompt for a record: the with-input template when ``input`` is non-empty."""
    if record.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=record["instruction"], input=record["input"])
    return PROMPT_NO_INPUT.format(instruction=record["instruction"])


def encode_records(records: Sequence[dict[str, str]], tokenizer: Any, model_max_length: int) -> list[dict[str, list[int]]]:
    """Token ids and labels for each record, truncated to ``model_max_length`` tokens.

    ``input_ids = prompt_ids + response_ids + [eos]`` and ``labels`` is the same with every prompt
    position set to -100. Truncation cuts the end (the response first), as the original recipe does.
    Prompts and responses are tokenized in two batched calls (fast for the 52K records of Alpaca).
    """
    if tokenizer.eos_token_id is None:
        raise AlpacaDataError("the tokenizer has no eos_token; set one (Qwen: '<|endoftext|>')")
    if not records:
        return []
    prompts = tokenizer([build_prompt(r) for r in records], add_special_tokens=False)["input_ids"]
    responses = tokenizer([r["output"] for r in records], add_special_tokens=False)["input_ids"]
    encoded = []
    for prompt_ids, response_ids in zip(prompts, responses, strict=True):
        response_ids = [*response_ids, tokenizer.eos_token_id]
        encoded.append({"input_ids": (prompt_ids + response_ids)[:model_max_length],
                        "labels": ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:model_max_length]})
    return encoded


def encode_record(record: dict[str, str], tokenizer: Any, model_max_length: int) -> dict[str, list[int]]:
    """:func:`encode_records` for one record."""
    return encode_records([record], tokenizer, model_max_length)[0]


class SupervisedDataset(torch.utils.data.Dataset):
    """Alpaca records tokenized up front (the data sets this recipe is for are small).

    A record whose prompt alone fills ``model_max_length`` has nothing left to learn; it is dropped
    and counted in ``dropped`` (a batch of only such records would give a NaN loss).
    """

    def __init__(self, records: Sequence[dict[str, str]], tokenizer: Any, model_max_length: int) -> None:
        if model_max_length < 2:
            raise AlpacaDataError(f"model_max_length must be at least 2, got {model_max_length}")
        encoded = encode_records(records, tokenizer, model_max_length)
        self.examples = [e for e in encoded if any(label != IGNORE_INDEX for label in e["labels"])]
        self.dropped = len(encoded) - len(self.examples)
        if not self.examples:
            raise AlpacaDataError(f"every record's prompt is at least model_max_length={model_max_length} tokens; "
                                  "raise --model_max_length")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


@dataclass
class SupervisedCollator:
    """Right-pads a batch: ``input_ids`` with the pad id, ``labels`` with -100, ``attention_mask`` 1/0.

    The mask and the padding labels come from each example's length, so a pad id equal to the EOS id
    (Qwen) never hides the real EOS.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        lengths = [len(e["input_ids"]) for e in examples]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, (example, length) in enumerate(zip(examples, lengths, strict=True)):
            input_ids[row, :length] = torch.tensor(example["input_ids"], dtype=torch.long)
            labels[row, :length] = torch.tensor(example["labels"], dtype=torch.long)
            attention_mask[row, :length] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def prepare_tokenizer(tokenizer: Any, model_max_length: int) -> Any:
    """Set the maximum length and, if the tokenizer has none, pad with the EOS token (as Qwen does).

    Adds no token: adding one would force an embedding resize (see the module docstring, pitfall 3).
    """
    if tokenizer.eos_token is None:
        raise AlpacaDataError("the tokenizer has no eos_token; set one (Qwen: '<|endoftext|>')")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = model_max_length
    return tokenizer


def check_vocab_fits(tokenizer: Any, model: Any) -> None:
    """Raise unless every token id of ``tokenizer`` has a row in the model's input embeddings.

    A larger embedding than ``len(tokenizer)`` is normal (Qwen pads 151,646 tokens to 151,936 rows)
    and must be left alone: never resize an embedding down to the tokenizer.
    """
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise AlpacaDataError(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows; "
                              "use the tokenizer saved with the model (or grow the embedding with "
                              "model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64))")
