"""No host waits in the training step: after the warm-up, xshard's own code reads no device value in a step.

On a GPU or an NPU the host runs ahead, queuing kernels; a read of a device value (``.item()``,
``.tolist()``, ``bool(t)`` ...) stops it until the device has drained its queue. DDP and FSDP2 read
none in a step; neither may xshard: forward, backward, clipping, the optimizer step, ``zero_grad`` and
the prepared loader's next batch, at every stage, with accumulation, bf16 and CPU offload, through the
Accelerator and the transformers Trainer, on the CPU backend and on the emulated CUDA and NPU code
paths (``tests/support/host_reads.py`` counts the calls xshard's frames make). The collectives
agreement check, which read its all-reduce's result at every step, runs off the training path
(``backends/collectives/agreement.py``); ``XSHARD_CHECK_COLLECTIVES=every-step`` brings the read back,
and the count shows it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

WARMUP, COUNTED = 3, 4  # optimizer steps
ACCUMULATION = 2


class TinyLM(torch.nn.Module):
    """Token ids in, with an attention mask: the throughput counter counts its tokens and FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(input_ids)).squeeze(-1) * attention_mask

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed


def _model_and_data(tokens: bool) -> tuple[torch.nn.Module, Any]:
    if tokens:
        ids = torch.randint(0, 32, (256, 6))
        mask = (torch.rand(256, 6) > 0.2).long()
        return TinyLM(), [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask, strict=True)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    return model, torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        return model(**batch).pow(2).mean()
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _train(config: dict[str, Any], tokens: bool = False) -> dict[str, Any]:
    """Optimizer steps with an Accelerator (the config's clipping and accumulation); the reads of the counted ones."""
    from support.host_reads import HostReads

    import xshard

    acc = xshard.Accelerator(config={"gradient_clipping": 1.0, "gradient_accumulation_steps": ACCUMULATION,
                                     "auto_wrap_policy": "size", "min_num_params": 64, **config}, seed=0)
    model, data = _model_and_data(tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    reads = HostReads()
    reads.counting = False
    steps = 0
    with reads:
        batches = iter(loader)
        while steps < WARMUP + COUNTED:
            reads.counting = steps >= WARMUP
            batch = next(batches)
            with acc.accumulate(model):
                acc.backward(_loss(model, batch))
                optimizer.step()
                optimizer.zero_grad()
            steps += acc.sync_gradients
    report = acc.throughput() if tokens else {}  # read here, as a loop that logs does, not in the counted steps
    acc.end_training()
    return {"per_step": reads.total / COUNTED, "where": dict(reads.where), "tokens": report.get("tokens")}


def _accelerator_worker(rank: int, world_size: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: _train(config, tokens="tokens" in name) for name, config in configs.items()}


CONFIGS = {f"stage {s}": {"stage": s} for s in (0, 1, 2, 3)}
CONFIGS.update({"stage 3 bf16": {"stage": 3, "mixed_precision": "bf16"},
                # fp16: torch's GradScaler reads its inf/nan verdict (.item()) in its step; xshard's code reads nothing
                "stage 3 fp16": {"stage": 3, "mixed_precision": "fp16"},
                "stage 1 tokens": {"stage": 1},
                "stage 3 offload": {"stage": 3, "offload_params": True, "offload_optimizer": True},
                "stage 2 hybrid": {"stage": 2, "shard_group_size": 1}})


def _assert_no_reads(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        for name, out in res.items():
            assert out["per_step"] == 0, f"rank {rank}, {name}: {out['per_step']} host reads a step: {out['where']}"


def test_no_host_read_in_a_step_at_any_stage() -> None:
    results = run_workers(_accelerator_worker, 2, CONFIGS, timeout=180)
    _assert_no_reads(results)
    assert all(res["stage 1 tokens"]["tokens"] > 0 for res in results)  # the throughput counter counted them


def _every_step_worker(rank: int, world_size: int) -> dict[str, Any]:
    import logging

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    handler.setLevel(logging.WARNING)
    logging.getLogger("xshard.backends").addHandler(handler)
    return {"stage 3": _train({"stage": 3}), "warnings": warnings}


def test_the_every_step_debug_check_reads_the_device_and_says_so() -> None:
    # the blocking check at every step (what every step did before the check left the training path):
    # its all-reduce's result read twice (.tolist()) a step, and rank 0 says so once at the start
    results = run_workers(_every_step_worker, 2, timeout=120, env={"XSHARD_CHECK_COLLECTIVES": "every-step"})
    for rank, res in enumerate(results):
        assert res["stage 3"]["per_step"] == 2, res["stage 3"]["where"]
        assert all("process_group.py" in where for where in res["stage 3"]["where"])
        said = [w for w in res["warnings"] if "XSHARD_CHECK_COLLECTIVES=every-step" in w]
        if rank == 0:
            assert len(said) == 1 and "the host waits for the device at each step" in said[0], res["warnings"]
        else:
            assert said == []


def test_an_unknown_check_setting_names_the_choices(monkeypatch) -> None:
    from xshard.backends.collectives.agreement import check_every_step

    monkeypatch.setenv("XSHARD_CHECK_COLLECTIVES", "always")
    with pytest.raises(ValueError, match=r"XSHARD_CHECK_COLLECTIVES='always' is not one of \('auto', 'every-step'\)"):
        check_every_step()


# ---------------------------------------------------------------- the emulated CUDA and NPU code paths


@contextlib.contextmanager
def _emulated(kind: str):
    """The CUDA or NPU backend's code path with its tensors on the CPU and its process group over gloo."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        if kind == "npu":
            from support.fakes.npu import install_fake_torch_npu

            install_fake_torch_npu(device_count=2)
            from xshard.backends.devices.npu import NPUBackend as cls

            # dist.barrier asks torch for the current accelerator, whose hooks the real torch_npu registers
            monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cpu"))
        else:
            from support.fakes.cuda import fake_cuda

            fake_cuda(monkeypatch, device_count=2)
            from xshard.backends.devices.cuda import CUDABackend as cls

            monkeypatch.setattr(cls, "dist_backend", "gloo")  # this CPU build of torch has no NCCL
            monkeypatch.setattr(cls, "process_group_options", lambda self: {})  # nor a GPU to bind it to
        monkeypatch.setattr(cls, "device", lambda self, local_rank=None: torch.device("cpu"))
        monkeypatch.setattr(cls, "autocast", lambda self, dtype=None, enabled=True: (
            torch.autocast("cpu", dtype=dtype) if enabled and dtype is not None else contextlib.nullcontext()))
        yield
    finally:
        monkeypatch.undo()


def _emulated_worker(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    os.environ["XSHARD_BACKEND"] = kind
    with _emulated(kind):
        return {f"{kind} stage {s}": _train({"stage": s, "mixed_precision": "bf16"}) for s in (0, 3)}


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_no_host_read_in_a_step_on_the_emulated_vendor_backends(kind: str) -> None:
    _assert_no_reads(run_workers(_emulated_worker, 2, kind, timeout=180))


# ---------------------------------------------------------------- the transformers Trainer


def _trainer_worker(rank: int, world_size: int, outdir: str) -> dict[str, Any]:
    from support.host_reads import HostReads
    from transformers import TrainerCallback

    from xshard.trainer import Trainer, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 256

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}

    reads = HostReads()
    reads.counting = False

    class CountAfterWarmup(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            reads.counting = WARMUP <= state.global_step < WARMUP + COUNTED

    args = TrainingArguments(output_dir=outdir, per_device_train_batch_size=4, max_steps=WARMUP + COUNTED + 1,
                             gradient_accumulation_steps=ACCUMULATION, max_grad_norm=1.0, logging_steps=1000,
                             save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True,
                             fsdp="full_shard")
    trainer = Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[CountAfterWarmup()])
    with reads:
        trainer.train()
    return {"trainer": {"per_step": reads.total / COUNTED, "where": dict(reads.where)}}


def test_no_host_read_in_a_trainer_step(tmp_path) -> None:
    _assert_no_reads(run_workers(_trainer_worker, 2, str(tmp_path), timeout=180))
