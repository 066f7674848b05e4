"""Training loops that leave the happy path, run identically by plain PyTorch and by the sharded core.

Each case builds a model (seeded, so every process builds the same one), and runs ``STEPS`` steps of
AdamW with weight decay (so a missing gradient and a zero gradient give different weights). The loop
sees ``take(t)``: this rank's rows of a global batch (the whole batch for the single-process
reference), so the averaged gradient of the sharded run is the full-batch gradient of the reference.

Models are PyTorch's own FSDP2 test models (``torch.testing._internal.common_fsdp.MLP`` and
``common_dtensor.Transformer``) arranged the way real loops differ from the happy path: blocks
skipped by step, a block run twice, weights shared across blocks, a forward of one block alone, layers
frozen and unfrozen, parameters of two dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 4
DIM = 12  # 12 * 3 = 36 and 12 * 4 = 48 hidden: rows divide by 2 but not by every world size
BATCH = 8


def _mlp(dim: int, multiplier: int) -> nn.Module:
    from torch.testing._internal.common_fsdp import MLP

    return MLP(dim, dim_multiplier=multiplier)


class Stack(nn.Module):
    """A stem, three FSDP-test MLP blocks and a head; ``forward(x, skip=..., twice=...)``."""

    _no_split_modules = ["MLP"]

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([_mlp(DIM, 3), _mlp(DIM, 4), _mlp(DIM, 3)])
        self.head = nn.Linear(DIM, 1)
        if tie:  # one weight in two blocks (two units): it lands in the root unit
            self.blocks[2].in_proj.weight = self.blocks[0].in_proj.weight

    def forward(self, x: torch.Tensor, skip: int | None = None, twice: int | None = None) -> torch.Tensor:
        h = self.stem(x)
        for i, block in enumerate(self.blocks):
            if i == skip:
                continue
            h = block(h)
            if i == twice:
                h = block(h)
        return self.head(h).squeeze(-1)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, generator=g)


def _mse(model: Callable[..., torch.Tensor], take: Callable[[torch.Tensor], torch.Tensor], step: int,
         **kwargs: Any) -> torch.Tensor:
    x, y = _data(step)
    return F.mse_loss(model(take(x), **kwargs), take(y))


def _stack_loop(plan: Callable[[int], dict[str, Any]]) -> Callable[..., None]:
    def loop(model: nn.Module, module: nn.Module, step: int, take: Callable) -> torch.Tensor:
        return _mse(model, take, step, **plan(step))
    return loop


def _nonroot(model: nn.Module, module: nn.Module, step: int, take: Callable) -> torch.Tensor:
    """Step 1 runs one block alone (a forward and backward that never enter the root)."""
    if step == 1:
        x, _ = _data(step)
        return module.blocks[1](take(x)).pow(2).mean()
    return _mse(model, take, step)


def _freeze(model: nn.Module, module: nn.Module, step: int, take: Callable) -> torch.Tensor:
    """Block 0 frozen at step 1, unfrozen at step 3; the head frozen at step 2 only."""
    if step == 1:
        module.blocks[0].requires_grad_(False)
    if step == 2:
        module.head.requires_grad_(False)
    if step == 3:
        module.blocks[0].requires_grad_(True)
        module.head.requires_grad_(True)
    return _mse(model, take, step)


class MixedStack(Stack):
    """Block 1 holds bf16 parameters (and computes in bf16), the rest fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1].to(torch.bfloat16)

    def forward(self, x: torch.Tensor, skip: int | None = None, twice: int | None = None) -> torch.Tensor:
        h = self.blocks[0](self.stem(x))
        h = self.blocks[1](h.to(torch.bfloat16)).float()
        return self.head(self.blocks[2](h)).squeeze(-1)


def _transformer() -> nn.Module:
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    model = Transformer(ModelArgs(n_layers=2, vocab_size=29, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0,
                                  weight_tying=True))
    model._no_split_modules = ["TransformerBlock"]
    return model


def _tokens(model: nn.Module, module: nn.Module, step: int, take: Callable) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, 29, (BATCH, 7), generator=g)
    logits = model(take(ids[:, :-1]))
    return F.cross_entropy(logits.reshape(-1, 29), take(ids[:, 1:]).reshape(-1))


#: name -> (builder, loop(model, module, step, take) -> loss, tolerance)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], float]] = {
    # block i skipped in step i (0: none): a unit prefetched in a step where it does not run
    "skipped_blocks": (Stack, _stack_loop(lambda s: {"skip": s - 1 if s else None}), 1e-5),
    "block_run_twice": (Stack, _stack_loop(lambda s: {"twice": s % 3}), 1e-5),
    "weight_shared_across_blocks": (lambda: Stack(tie=True), _stack_loop(lambda s: {"skip": 2 if s == 2 else None}),
                                    1e-5),
    "non_root_forward": (Stack, _nonroot, 1e-5),
    "freeze_and_unfreeze": (Stack, _freeze, 1e-5),
    "transformer": (_transformer, _tokens, 2e-5),
    # bf16 rounding differs between a full-batch gradient and an average of two halves; SGD (below)
    # keeps that noise proportional, where Adam would turn it into whole-lr steps
    "mixed_dtypes": (MixedStack, _stack_loop(lambda s: {}), 1e-3),
}

#: cases that train with SGD (momentum and weight decay: a missing and a zero gradient still differ)
SGD_CASES = {"mixed_dtypes"}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]()


def train(name: str, model: nn.Module, module: nn.Module, take: Callable[[torch.Tensor], torch.Tensor],
          params: list[nn.Parameter] | None = None) -> dict[str, Any]:
    """Run the case; returns per-step losses and which parameters had no gradient after each backward."""
    loop = CASES[name][1]
    params = list(dict.fromkeys(module.parameters())) if params is None else params
    if name in SGD_CASES:
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if hasattr(model, "register_optimizer"):
        model.register_optimizer(opt)
    losses, missing = [], []
    for step in range(STEPS):
        loss = loop(model, module, step, take)
        loss.backward()
        losses.append(loss.item())
        missing.append([p.grad is None for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "missing": missing}


def reference(name: str) -> dict[str, Any]:
    """Plain PyTorch, one process, the whole batch."""
    model = build(name)
    out = train(name, model, model, lambda t: t)
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out
