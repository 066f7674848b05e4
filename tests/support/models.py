"""Tiny models shared by tests: a transformer-shaped LM with awkward sizes, a tiny Qwen2, and a residual
regression net (the Accelerator and checkpoint tests' model) with its data.

Sizes are chosen so that no dimension divides by 2 or 4 where it matters (padding is exercised),
and the LM head is tied to the embedding by default (tied weights across modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

VOCAB = 23


class Block(nn.Module):
    """Pre-norm residual MLP block: the "transformer layer" of TinyLM."""

    def __init__(self, dim: int, hidden: int, gated: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        # a parameter of the block itself, beside its children's (size-based units can then nest)
        self.gate = nn.Parameter(torch.full((dim,), 0.5)) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.tanh(self.up(self.norm(x))))
        return x + (y * self.gate if self.gate is not None else y)


class TinyLM(nn.Module):
    """Embedding -> Blocks -> LayerNorm -> head (tied to the embedding unless ``tie=False``)."""

    _no_split_modules = ["Block"]

    def __init__(self, dim: int = 10, hidden: int = 14, layers: int = 3, vocab: int = VOCAB, tie: bool = True,
                 reuse_first: bool = False, checkpoint_calls: bool = False, gated: bool = False):
        super().__init__()
        # the model checkpoints its own blocks by calling them inside torch.utils.checkpoint, so the
        # recompute in backward re-enters block.__call__ (and its hooks)
        self.checkpoint_calls = checkpoint_calls
        self.reuse_first = reuse_first  # call blocks[0] a second time at the end (a unit run twice per step)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, gated) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(()))  # 0-dim: one element, empty shards on ranks > 0
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            if self.checkpoint_calls and torch.is_grad_enabled():
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute runs to the end
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.reuse_first:
            x = self.blocks[0](x)
        logits = self.head(self.norm(x)) * self.logit_scale
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class ResidualBlock(nn.Module):
    """LayerNorm -> Linear -> tanh: one block of ``RegressionNet`` (the net adds the residual)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.norm(h)))


class RegressionNet(nn.Module):
    """``dim`` features -> ``depth`` residual blocks of ``width`` (dropout on each block's output) -> one value;
    ``forward(x, y)`` returns the MSE loss against ``y``. Units: one per ``ResidualBlock``."""

    _no_split_modules = ["ResidualBlock"]

    def __init__(self, dim: int = 8, width: int = 16, depth: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + self.drop(block(h))
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def regression_data(n: int = 32, dim: int = 8) -> torch.utils.data.TensorDataset:
    """``n`` fixed random inputs of ``dim`` features and their targets ``sin(sum(x))``."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(-1).sin())


def make_tiny(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def make_qwen2(seed: int = 0) -> nn.Module:
    """A 2-layer Qwen2ForCausalLM with hidden size 32 and a 61-token vocabulary (random weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=61, hidden_size=32, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def batch(step: int, size: int, seq: int = 6, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids and next-token labels for global step ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """AdamW groups: decay on matrices, none on norms, biases and other vectors."""
    decay, no_decay = [], []
    for p in dict.fromkeys(model.parameters()):
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
