"""Static shapes for any batch: the tensors the user names are padded to a multiple (xshard.static_shapes)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader

from xshard.runtime.data import shard_data_loader
from xshard.static_shapes import PadToMultiple

Pair = namedtuple("Pair", "tokens labels")


def _ragged(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Samples of lengths 3..3+n-1, token ids from 1, labels equal to the tokens."""
    return [(torch.arange(1, 4 + i), torch.arange(1, 4 + i)) for i in range(n)]


def _pad_collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads each batch to its own longest sample (the shapes vary from batch to batch)."""
    tokens = torch.nn.utils.rnn.pad_sequence([s[0] for s in samples], batch_first=True)
    labels = torch.nn.utils.rnn.pad_sequence([s[1] for s in samples], batch_first=True, padding_value=-100)
    return tokens, labels


def test_named_tuple_positions_are_padded_to_the_multiple_with_their_values() -> None:
    loader = DataLoader(_ragged(12), batch_size=3, collate_fn=PadToMultiple(_pad_collate, 8, keys={0: 0, 1: -100}))
    widths = set()
    for tokens, labels in loader:
        assert tokens.shape[1] % 8 == 0 and tokens.shape == labels.shape
        lengths = (tokens != 0).sum(1)
        for row, n in enumerate(lengths.tolist()):
            assert torch.equal(tokens[row, :n], torch.arange(1, n + 1))  # the data is untouched
            assert (labels[row, n:] == -100).all()  # new positions are ignored by the loss
        widths.add(tokens.shape[1])
    unpadded = {_pad_collate(_ragged(12)[i:i + 3])[0].shape[1] for i in range(0, 12, 3)}
    assert len(unpadded) == 4 and widths == {8, 16}  # 4 widths without padding, 2 with


def test_dicts_with_other_keys_and_namedtuples_keep_their_type() -> None:
    def as_dict(samples):
        tokens, labels = _pad_collate(samples)
        return {"pixels": tokens.float(), "target": labels, "ids": [1] * len(samples)}

    batch = PadToMultiple(as_dict, 16, keys=["pixels"])(_ragged(2))
    assert batch["pixels"].shape == (2, 16) and batch["target"].shape == (2, 4) and batch["ids"] == [1, 1]
    pair = PadToMultiple(lambda s: Pair(*_pad_collate(s)), 4, keys={0: 0})(_ragged(2))
    assert isinstance(pair, Pair) and pair.tokens.shape == (2, 4) and pair.labels.shape == (2, 4)


def test_a_name_the_batch_does_not_have_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match=r"no \['input'\].*by key .* or position"):
        PadToMultiple(lambda s: {"x": torch.zeros(2, 3)}, 8, keys=["input"])([None])
    with pytest.raises(ValueError, match="not a tensor with a dim 1"):
        PadToMultiple(lambda s: (torch.zeros(2),), 8, keys=[0])([None])
    with pytest.raises(TypeError, match="dict, tuple or list"):
        PadToMultiple(lambda s: torch.zeros(2, 3), 8, keys=[0])([None])


def test_a_prepared_loader_keeps_the_users_hook() -> None:
    hook = PadToMultiple(_pad_collate, 8, keys={0: 0, 1: -100})
    loader = DataLoader(_ragged(12), batch_size=3, collate_fn=hook)
    prepared = shard_data_loader(loader, torch.device("cpu"), pad_to_multiple_of=64)
    assert {tuple(t.shape[1] for t in batch) for batch in prepared} == {(8, 8), (16, 16)}
