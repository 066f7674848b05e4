"""Throughput in every run: tokens/s per device, TFLOPs per device and MFU (``xshard.runtime.throughput``).

What a user reads off a run must be what the run did: the tokens counted are the batches' non-padding tokens
after the warm-up step, the FLOPs are the stated formula times those tokens, the peak is the device's published
figure (or the override), and the Trainer's log lines carry them.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.models import make_qwen2

from xshard import Accelerator
from xshard.errors import XShardError
from xshard.runtime.throughput import PEAK_ENV, ModelFlops, peak_flops


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.5),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A100-SXM4-80GB", None, 19.5),
    ("NVIDIA H200", torch.float16, 989.4),
    ("AMD Instinct MI300X", torch.bfloat16, 1307.4),
    ("Ascend910B2", torch.bfloat16, 376.0),
    ("Ascend910C", torch.bfloat16, 752.0),
    ("v5litepod-8", torch.bfloat16, 197.0),
    ("v5p-8", torch.bfloat16, 459.0),
    ("v6e-8", torch.bfloat16, 918.0),
    ("v4-8", torch.bfloat16, 275.0),
])
def test_the_peak_is_the_devices_published_figure(name: str, dtype: torch.dtype | None, expected: float) -> None:
    peak = peak_flops(name, dtype, env={})
    assert peak.tflops == expected and peak.source


def test_an_unknown_device_has_no_mfu_and_says_how_to_give_one() -> None:
    peak = peak_flops("Some Accelerator 9000", torch.bfloat16, env={})
    assert peak.tflops is None and PEAK_ENV in peak.source


def test_the_override_wins_and_a_bad_one_names_the_fix() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16, env={PEAK_ENV: "500"}).tflops == 500.0
    with pytest.raises(XShardError, match=f"{PEAK_ENV}='fast' is not a positive number"):
        peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16, env={PEAK_ENV: "fast"})


def test_the_flops_of_a_decoder_token_follow_the_stated_formula() -> None:
    model = make_qwen2()
    flops = ModelFlops.of(model, lambda p: p.numel())
    n = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    embedding = model.get_input_embeddings().weight.numel()
    assert (flops.params, flops.embedding_params, flops.layers, flops.width) == (n, embedding, 2, 32)
    assert flops.per_token(16) == 6 * (n - embedding) + 12 * 2 * 32 * 16
    assert flops.formula.startswith("6N + 12*L*d*s")


def _padded_batches(steps: int, size: int = 4, seq: int = 10) -> list[dict[str, torch.Tensor]]:
    out = []
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = torch.randint(0, 61, (size, seq), generator=g)
        mask = torch.ones(size, seq, dtype=torch.long)
        mask[:, seq - 1 - step % 3:] = 0  # padding on the right, a different amount each step
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids})
    return out


def _train(acc: Accelerator, batches: list[dict[str, torch.Tensor]]) -> tuple[ModelFlops, dict]:
    model = make_qwen2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    flops = acc.job.throughput.models[0]
    for batch in batches:
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return flops, acc.throughput()


def test_a_run_reports_its_non_padding_tokens_and_their_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "2.0")
    batches = _padded_batches(5)
    acc = Accelerator(backend="cpu")
    flops, report = _train(acc, batches)
    acc.end()
    timed = batches[1:]  # the first step is warm-up
    real = sum(int(b["attention_mask"].sum()) for b in timed)
    assert (report["steps"], report["samples"], report["tokens"]) == (4, 16, 4 * 40)
    assert report["non_padding_tokens"] == real < report["tokens"]
    assert report["tokens_per_second_per_device"] == pytest.approx(real / report["seconds"])
    assert report["tflops_per_device"] * 1e12 * report["seconds"] == pytest.approx(flops.per_token(10) * real)
    assert report["mfu"] == pytest.approx(report["tflops_per_device"] / 2.0)
    assert report["peak_source"] == PEAK_ENV


def test_a_cpu_measures_its_peak_when_nothing_names_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)
    acc = Accelerator(backend="cpu")
    _, report = _train(acc, _padded_batches(3))
    acc.end()
    assert report["peak_source"].startswith("measured") and report["peak_tflops"] > 0
    assert 0 < report["mfu"] < 1


def test_a_report_opens_a_new_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "1.0")
    acc = Accelerator(backend="cpu")
    _train(acc, _padded_batches(3))
    again = acc.throughput()
    acc.end()
    assert (again["steps"], again["tokens"], again["tokens_per_second_per_device"]) == (0, 0, None)


def _sharded_count(rank: int, world_size: int) -> tuple[int, int]:
    acc = Accelerator(backend="cpu", stage=3)
    flops, report = _train(acc, _padded_batches(3))
    acc.end()
    return flops.params, report["tokens"]


@pytest.mark.multiprocess
def test_stage_3_counts_the_whole_model_not_this_ranks_shard() -> None:
    whole = sum(p.numel() for p in make_qwen2().parameters())
    assert run_workers(_sharded_count, 2) == [(whole, 2 * 40), (whole, 2 * 40)]


def test_the_trainers_log_lines_carry_the_throughput(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "1.0")
    from xshard.trainer import Trainer, TrainingArguments

    rows = [{k: v[i] for k, v in batch.items()} for batch in _padded_batches(4) for i in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, logging_steps=2,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0)
    trainer = Trainer(model=make_qwen2(), args=args, train_dataset=rows)
    trainer.train()
    lines = [line for line in trainer.state.log_history if "loss" in line]
    # the first line's window holds one timed step (the first is warm-up), the second two
    assert [sorted(k for k in line if k in ("train_tokens_per_second_per_device", "train_tflops_per_device", "mfu"))
            for line in lines] == [["mfu", "train_tflops_per_device", "train_tokens_per_second_per_device"]] * 2
    assert all(line["mfu"] == pytest.approx(line["train_tflops_per_device"]) for line in lines)


def test_the_cpu_peak_probe_never_draws_from_the_scripts_random_stream(clean_env):
    # it runs at the first throughput report, in the middle of training: a draw there moved every later
    # dropout mask and sampled completion (TRL's GRPO steps differed from the stock trainer's from step 2)
    from xshard.backends import get_backend

    backend = get_backend("cpu")
    before = torch.get_rng_state().clone()
    assert backend.measured_peak_tflops(torch.float32, size=64, seconds=0.01) > 0
    assert torch.equal(torch.get_rng_state(), before)
