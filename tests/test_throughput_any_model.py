"""The throughput counter never stops a run: any model prepares and trains, and gets a FLOPs estimate where
the formula applies or one INFO line (and a report entry) saying why it has none.

A ResNet crashed ``prepare()`` (transformers' ``get_input_embeddings`` raises NotImplementedError on a model
without input embeddings), so no vision model could start through the Accelerator or the Trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from support.models import make_qwen2

from xshard import Accelerator
from xshard.runtime.throughput import PEAK_ENV, ModelFlops


def _whole(p: torch.Tensor) -> int:
    return p.numel()


def _resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                     num_labels=3))


@pytest.fixture
def throughput_lines() -> Iterator[list[str]]:
    """The lines the throughput counter logs (xshard's logger keeps its own handler: read it directly)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("xshard.throughput")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_vision_model_trains_and_its_report_says_why_it_has_no_flops(
        monkeypatch: pytest.MonkeyPatch, throughput_lines: list[str]) -> None:
    monkeypatch.setenv(PEAK_ENV, "1.0")
    acc = Accelerator(backend="cpu")
    model = _resnet()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(4):
        out = model(pixel_values=torch.randn(4, 3, 32, 32), labels=torch.tensor([0, 1, 2, step % 3]))
        acc.backward(out.loss)
        opt.step()
        opt.zero_grad()
    report = acc.throughput()
    acc.end()
    assert report["steps"] == 3 and report["samples"] == 3 * 4 and report["samples_per_second"] > 0
    assert (report["tflops_per_device"], report["mfu"], report["flops_formula"]) == (None, None, None)
    assert report["tokens_per_second_per_device"] is None
    assert "ResNetForImageClassification" in report["no_flops_reason"]
    assert "pixel_values" in report["no_flops_reason"]
    assert [line for line in throughput_lines if "no TFLOPs or MFU" in line] == [
        f"throughput: no TFLOPs or MFU for this run: {report['no_flops_reason']}"]  # once, not once a step


def test_the_trainer_trains_a_vision_model(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "1.0")
    from xshard.trainer import Trainer, TrainingArguments

    rows = [{"pixel_values": torch.randn(3, 32, 32), "labels": i % 3} for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0)
    trainer = Trainer(model=_resnet(), args=args, train_dataset=rows)
    trainer.train()
    lines = [line for line in trainer.state.log_history if "loss" in line]
    assert len(lines) == 2 and not any("mfu" in line for line in lines)  # no made-up MFU


def test_a_plain_module_fed_token_ids_gets_the_attention_free_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "1.0")
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    flops = ModelFlops.of(model, _whole)
    assert flops.formula == "6N (no attention term)" and flops.per_token(7) == 6 * (50 * 8 + 8 * 50 + 50)
    acc = Accelerator(backend="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        ids = torch.randint(0, 50, (2, 7))
        acc.backward(torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
        opt.step()
        opt.zero_grad()
    report = acc.throughput()
    acc.end()
    assert report["no_flops_reason"] is None and report["tokens"] == 2 * 14 and report["mfu"] > 0


def test_a_float_batch_is_not_counted_as_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "1.0")
    acc = Accelerator(backend="cpu")
    model = torch.nn.Linear(16, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        acc.backward(model(torch.randn(8, 16)).square().mean())
        opt.step()
        opt.zero_grad()
    report = acc.throughput()
    acc.end()
    assert (report["tokens"], report["samples"], report["mfu"]) == (0, 16, None)
    assert "no token ids" in report["no_flops_reason"]


class _NoEmbeddings(torch.nn.Module):
    """A model whose ``get_input_embeddings`` raises, as transformers' does on a model without one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def get_input_embeddings(self) -> torch.nn.Module:
        raise NotImplementedError("no input embeddings")


def test_a_model_without_embeddings_or_config_is_counted_whole() -> None:
    flops = ModelFlops.of(_NoEmbeddings(), _whole)
    assert (flops.params, flops.embedding_params, flops.layers, flops.width) == (20, 0, None, None)


class _Unreadable(torch.nn.Module):
    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        raise RuntimeError("parameters are on another planet")


def test_a_model_whose_parameters_cannot_be_read_has_no_estimate_and_says_why() -> None:
    flops = ModelFlops.of(_Unreadable(), _whole)
    assert flops.formula is None and "RuntimeError: parameters are on another planet" in flops.no_flops_reason


@pytest.mark.parametrize("family", ["t5", "bart", "clip", "peft", "compiled"])
def test_every_model_family_gets_the_decoder_formula_from_its_config(family: str) -> None:
    import transformers as tf

    if family == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                          num_heads=2))
        layers, width = 2, 16
    elif family == "bart":
        model = tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
        layers, width = 1, 16
    elif family == "clip":  # two towers: no input embedding to name, the text config gives L and d
        text = {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3,
                "num_attention_heads": 2}
        vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 16, "patch_size": 8}
        model = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
        layers, width = 3, 16
    else:
        model = make_qwen2()
        layers, width = 2, 32
        if family == "peft":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        else:
            model = torch.compile(model)
    flops = ModelFlops.of(model, _whole)
    assert (flops.layers, flops.width, flops.no_flops_reason) == (layers, width, None)
    assert flops.params == sum(p.numel() for p in model.parameters())
    assert flops.formula is not None and flops.formula.startswith("6N + 12*L*d*s")
    if family == "compiled":
        assert flops.name == "Qwen2ForCausalLM"  # the log names the model, not torch's wrapper


def test_a_batch_the_counter_cannot_read_leaves_the_forward_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "1.0")

    class OddIds(torch.nn.Module):  # its ids' first dimension cannot be read (a 0-dim tensor named input_ids)
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.embed(input_ids).sum()

    acc = Accelerator(backend="cpu")
    model = OddIds()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        acc.backward(model(input_ids=torch.tensor(3)))
        opt.step()
        opt.zero_grad()
    report = acc.throughput()
    acc.end()
    assert report["steps"] == 2 and report["mfu"] is None and "could not be counted" in report["no_flops_reason"]
