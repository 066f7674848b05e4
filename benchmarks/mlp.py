"""The benchmark model: a stack of residual MLP blocks (d -> 4d -> d), 8 d^2 parameters per block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """x + W2 gelu(W1 x): the shape of a transformer's feed-forward layer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    """``n_blocks`` blocks; each block is one wrapping unit for every sharded framework."""

    _no_split_modules = ["Block"]  # the unit xshard's "transformer" wrap policy picks by default

    def __init__(self, d: int, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_model(d: int, n_blocks: int, seed: int = 0) -> MLP:
    """The same initial weights on every rank."""
    torch.manual_seed(seed)
    return MLP(d, n_blocks)


def make_batch(global_batch: int, seq: int, d: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of the global batch: ``global_batch // world_size`` sequences of ``seq`` tokens."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(global_batch // world_size, seq, d, generator=gen)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    """A scalar that depends on every output (the benchmark measures cost, not learning)."""
    return out.float().pow(2).mean()
