"""Transformers' hub kernels on a device the ``kernels`` library refuses (torch_xla's ``xla``).

transformers 5.25 kernelizes a loaded model again at every ``model.train()``, on its parameters' device, and
the ``kernels`` library refuses a device type it does not know: a TPU user's first training step failed with
``ValueError: Unsupported device type 'xla'``. The meta device stands in for XLA here (the library refuses it
the same way); tests/test_xla_users_scripts.py trains on a real XLA device with the Trainer.
"""

from __future__ import annotations

import logging

import pytest
import transformers
from support.toy_backend import ToyBackend

from xshard.backends import register_backend, unregister_backend
from xshard.runtime.hub_kernels import turn_off_hub_kernels

NAME = "nokernels"


class NoHubKernelsBackend(ToyBackend):
    """A host device the kernels library would not run on, as torch_xla's."""

    name = NAME
    runs_hub_kernels = False


def _kernelized(folder):
    """The tiny model as ``from_pretrained`` gives it: kernelized by the newest transformers (``.venv``'s)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.use_kernels, f"transformers {transformers.__version__} no longer kernelizes a loaded model"
    return model


def test_a_model_moved_to_a_refused_device_trains_once_its_hub_kernels_are_off(tiny_model) -> None:
    stock = _kernelized(tiny_model).to("meta")
    with pytest.raises(ValueError, match="Unsupported device type 'meta'"):
        stock.train()  # what a TPU user met at the first step
    model = _kernelized(tiny_model).to("meta")  # moved before prepare, as scripts do with accelerator.device
    assert turn_off_hub_kernels(model, "meta")
    model.train()
    model.eval()
    assert not model.use_kernels and "_kernels_device" not in model.__dict__
    assert not turn_off_hub_kernels(model, "meta")  # nothing left to turn off


def test_prepare_turns_them_off_where_the_backend_says_its_device_runs_none_and_says_so(
        tiny_model, clean_env) -> None:
    import xshard

    said: list[logging.LogRecord] = []
    listener = logging.Handler(logging.INFO)
    listener.emit = said.append  # type: ignore[method-assign]
    logger = logging.getLogger("xshard.hub_kernels")  # what prepare logs through, on the main process
    register_backend(NAME, NoHubKernelsBackend)
    logger.addHandler(listener)
    try:
        acc = xshard.Accelerator(backend=NAME, stage=0)
        model = _kernelized(tiny_model)
        acc.prepare(model)
        acc.end()
    finally:
        logger.removeHandler(listener)
        unregister_backend(NAME)
    assert not model.use_kernels
    assert [r.levelno for r in said] == [logging.INFO], said
    assert "transformers' hub kernels turned off for the model" in said[0].getMessage()


def test_prepare_keeps_them_on_a_device_the_library_runs_on(tiny_model, clean_env) -> None:
    import xshard

    acc = xshard.Accelerator(backend="cpu", stage=0)
    model = _kernelized(tiny_model)
    acc.prepare(model)
    acc.end()
    assert model.use_kernels  # the stock behaviour: transformers' choice, untouched
