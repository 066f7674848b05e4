"""Accelerate's ``dynamo_backend`` / ``dynamo_plugin`` on xshard's Accelerator, in one process.

``accelerator.state.dynamo_plugin`` holds what Accelerate's holds for the same arguments (``to_dict`` and the
``torch.compile`` keywords ``to_kwargs`` gives), and ``prepare`` compiles the model with them: the prepared
model runs compiled graphs and trains to the losses of the same model compiled by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate.utils import TorchDynamoPlugin as AccelerateDynamoPlugin
from torch import nn

import xshard
from xshard.config.dynamo import read_dynamo_args


@pytest.fixture(autouse=True)
def _one_process(clean_env):
    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH",
                 "ACCELERATE_DYNAMO_USE_DYNAMIC", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"):
        clean_env.delenv(name, raising=False)
    torch._dynamo.reset()
    yield clean_env


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, backward) -> list[float]:
    generator = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        x, y = torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_dynamo_backend_compiles_the_prepared_model_to_the_hand_compiled_losses():
    from torch._dynamo.utils import counters

    reference = _net()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = _train(torch.compile(reference, backend="aot_eager"), optimizer, lambda loss: loss.backward())
    torch._dynamo.reset()
    counters.clear()
    acc = xshard.Accelerator(dynamo_backend="aot_eager", cpu=True)
    model = _net()
    prepared, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert _train(prepared, optimizer, acc.backward) == pytest.approx(expected, rel=1e-6)
    assert counters["stats"]["unique_graphs"] > 0, "prepare did not compile the model"
    assert acc.state.dynamo_plugin.to_dict() == AccelerateDynamoPlugin(backend="aot_eager").to_dict()
    assert acc.unwrap_model(prepared) is model  # compiled in place: the prepared model is still the one returned
    acc.end()


def test_no_dynamo_argument_compiles_nothing_and_reports_accelerates_default():
    from torch._dynamo.utils import counters

    counters.clear()
    acc = xshard.Accelerator(cpu=True)
    assert acc.state.dynamo_plugin.to_dict() == AccelerateDynamoPlugin().to_dict()
    assert acc.state.dynamo_plugin.backend == "NO"
    model = _net()
    prepared, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(prepared, optimizer, acc.backward)
    assert counters["stats"]["unique_graphs"] == 0
    acc.end()


@pytest.mark.parametrize("given", [
    {"dynamo_plugin": AccelerateDynamoPlugin(backend="eager", mode="reduce-overhead", fullgraph=True, dynamic=False)},
    {"dynamo_backend": "INDUCTOR"},
    {},
], ids=["accelerates_plugin", "backend_name", "environment"])
def test_the_plugin_and_its_compile_keywords_are_accelerates(given, _one_process):
    _one_process.setenv("ACCELERATE_DYNAMO_BACKEND", "aot_eager")  # what `accelerate launch --dynamo_backend` sets
    _one_process.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    ours = read_dynamo_args(given.get("dynamo_backend"), given.get("dynamo_plugin"))
    theirs = given.get("dynamo_plugin") or AccelerateDynamoPlugin(backend=given.get("dynamo_backend"))
    assert ours.to_dict() == theirs.to_dict()
    assert ours.to_kwargs() == theirs.to_kwargs()


def test_both_arguments_or_an_unknown_backend_are_errors():
    with pytest.raises(ValueError, match="both `dynamo_plugin` and `dynamo_backend`"):
        xshard.Accelerator(dynamo_backend="eager", dynamo_plugin=AccelerateDynamoPlugin(backend="eager"), cpu=True)
    with pytest.raises(ValueError, match="'inductr' is not one Accelerate knows: choose one of no, eager"):
        xshard.Accelerator(dynamo_backend="inductr", cpu=True)


def test_regional_compilation_is_warned_and_the_whole_model_compiled():
    acc = xshard.Accelerator(dynamo_plugin=AccelerateDynamoPlugin(backend="eager", use_regional_compilation=True),
                             cpu=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.prepare(_net())
    assert [str(w.message) for w in caught if "use_regional_compilation" in str(w.message)] == [
        "TorchDynamoPlugin(use_regional_compilation=True): xshard compiles the whole prepared model (compile the "
        "repeated blocks yourself with block.compile() before prepare for regional compilation)"]
    acc.end()


def test_accelerates_own_state_holds_the_same_plugin():
    """A script that imported Accelerate reads the job's plugin from ``accelerate.state.AcceleratorState`` too."""
    import accelerate.state

    acc = xshard.Accelerator(dynamo_backend="eager", cpu=True)
    try:
        assert accelerate.state.AcceleratorState._shared_state["dynamo_plugin"] is acc.state.dynamo_plugin
        assert accelerate.state.AcceleratorState().dynamo_plugin.backend != accelerate.utils.DynamoBackend.NO
    finally:
        acc.end()
