"""The device check's workers: what one process of ``device_check.py`` runs for each part.

A worker receives a spec (the part, the device, the sizes, the configurations to run one after another)
and returns one result per configuration; a configuration that fails is recorded with its error and the
next one still runs. Parts: ``correctness`` (xshard against plain PyTorch on the same device),
``syncs`` (host syncs made by xshard's code after the warm-up), ``speed`` (a Qwen2-shaped model, tokens/s,
MFU, the device's idle share), ``async_save`` (the training stall of an async ``save_state`` against a
blocking one) and ``offload`` (step time with CPU offload against without, host-to-device copy overlap).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))

from device_check_probes import SyncCounter, copy_overlap, idle_share, synchronize  # noqa: E402
from mlp import make_model  # noqa: E402

#: tolerances of xshard against plain PyTorch on the same device, per dtype (fp32 as tests/test_sharding_parity.py
#: and tests/test_accelerator.py; bf16 as the parity suite's low-precision cases: the bf16 compute copies and
#: gradients at stage 3 round where autocast keeps fp32, so 2e-2 relative)
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"loss_rtol": 1e-5, "grad_norm_rtol": 1e-4, "weight_atol": 1e-5, "weight_rtol": 1e-5},
    "bf16": {"loss_rtol": 2e-2, "grad_norm_rtol": 2e-2, "weight_atol": 2e-2, "weight_rtol": 2e-2},
}


# ------------------------------------------------------------------------------------------- the device
def rank_and_world() -> tuple[int, int]:
    """This process's rank and the job's size (torchrun's variables, set by rank_runner)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def torch_device(kind: str) -> torch.device:
    """This rank's device of ``kind`` (cuda, npu or cpu)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)))


def free_memory(device: torch.device) -> None:
    """Give the caching allocator's blocks back between configurations of one process."""
    gc.collect()
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None:
        module.empty_cache()


def regression_batches(spec: dict[str, Any], steps: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The same ``steps`` full batches (inputs, targets) in every process: seeded on the host, then moved."""
    gen = torch.Generator().manual_seed(1234)
    shape = (spec["batch"], spec["seq"], spec["d"])
    return [(torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device))
            for _ in range(steps)]


def my_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous share of a global batch."""
    rank, world = rank_and_world()
    share = t.shape[0] // world
    return t[rank * share:(rank + 1) * share]


# ------------------------------------------------------------------------------------------- correctness
def correctness(spec: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the MLP ``spec["steps"]`` AdamW steps (clipping at 1.0) plainly or through xshard; return losses,
    gradient norms before clipping, and (plain) the final weights' file or (xshard) the comparison with it."""
    device = torch_device(spec["device"])
    bf16 = cfg["dtype"] == "bf16"
    batches = regression_batches(spec, spec["steps"], device)
    model = make_model(spec["d"], spec["blocks"])
    losses, norms = [], []
    if cfg["impl"] == "plain":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        torch.save({"losses": losses, "norms": norms, "state": state}, cfg["reference_file"])
        return {"losses": losses, "grad_norms": norms}
    import xshard

    acc = xshard.Accelerator(config={
        "stage": cfg["stage"], "mixed_precision": "bf16" if bf16 else "no",
        "activation_checkpointing": cfg.get("checkpointing", False),
        "offload_params": cfg.get("offload", False), "offload_optimizer": cfg.get("offload", False)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for x, y in batches:
        x, y = my_rows(x).to(acc.device), my_rows(y).to(acc.device)
        loss = F.mse_loss(model(x).float(), y)
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
    state = {k: v.detach().float().cpu() for k, v in acc.get_state_dict(model).items()}
    acc.end()
    reference = torch.load(cfg["reference_file"])
    return {"losses": losses, "grad_norms": norms, **compare(losses, norms, state, reference, cfg["dtype"])}


def compare(losses: list[float], norms: list[float], state: dict[str, torch.Tensor], reference: dict[str, Any],
            dtype: str) -> dict[str, Any]:
    """The largest differences from the plain run and whether each is within the dtype's tolerance."""
    tol = TOLERANCES[dtype]

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-12)

    loss_rel = max(rel(a, b) for a, b in zip(losses, reference["losses"], strict=True))
    norm_rel = max(rel(a, b) for a, b in zip(norms, reference["norms"], strict=True))
    missing = sorted(set(reference["state"]) ^ set(state))
    excess = 0.0  # the largest |a - b| - (atol + rtol |b|): > 0 means outside the tolerance
    weight_abs = 0.0
    for key, ref in reference["state"].items():
        if key in state:
            diff = (state[key] - ref).abs()
            weight_abs = max(weight_abs, float(diff.max()))
            excess = max(excess, float((diff - tol["weight_atol"] - tol["weight_rtol"] * ref.abs()).max()))
    passed = (loss_rel <= tol["loss_rtol"] and norm_rel <= tol["grad_norm_rtol"] and excess <= 0 and not missing)
    return {"max_loss_rel": loss_rel, "max_grad_norm_rel": norm_rel, "max_weight_abs": weight_abs,
            "keys_not_in_both": missing, "tolerance": tol, "passed": passed}


# ------------------------------------------------------------------------------------------- host syncs
def syncs(spec: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The host syncs xshard's code makes in the optimizer steps after the warm-up (2 micro-batches
    accumulated, clipping from the config, bf16): on a GPU torch's sync debug mode, each warning put on the
    innermost frame of xshard's code; on the CPU the device reads xshard's code calls (support/host_reads)."""
    import xshard

    device = torch_device(spec["device"])
    acc = xshard.Accelerator(config={"stage": cfg["stage"], "mixed_precision": "bf16", "gradient_clipping": 1.0,
                                     "gradient_accumulation_steps": 2})
    model = make_model(spec["d"], spec["blocks"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn(2 * spec["batch"] * (spec["warmup"] + spec["steps"]),
                                                      spec["seq"], spec["d"]))
    loader = torch.utils.data.DataLoader(data, batch_size=spec["batch"])
    model, opt, loader = acc.prepare(model, opt, loader)
    counter = SyncCounter(device)
    steps = 0
    with counter:
        for (x,) in loader:
            counter.counting = spec["warmup"] <= steps < spec["warmup"] + spec["steps"]
            with acc.accumulate(model):
                acc.backward(model(x).float().pow(2).mean())
                opt.step()
                opt.zero_grad()
            steps += acc.sync_gradients
    acc.end()
    return {"method": counter.method, "from_xshard": sum(counter.xshard.values()),
            "xshard_sources": dict(counter.xshard), "other_sources": dict(counter.other.most_common(10)),
            "counted_steps": spec["steps"]}


# ------------------------------------------------------------------------------------------- speed
def qwen2_config(spec: dict[str, Any]) -> Any:
    """The Qwen2-shaped model of the speed part (``spec["model"]``: hidden, layers, heads, kv_heads, ...)."""
    from transformers import Qwen2Config

    m = spec["model"]
    return Qwen2Config(hidden_size=m["hidden"], num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                       num_key_value_heads=m["kv_heads"], intermediate_size=m["intermediate"],
                       vocab_size=m["vocab"], max_position_embeddings=spec["seq"], tie_word_embeddings=True,
                       attn_implementation="sdpa")


def speed(spec: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s, MFU and the idle share of one way of training the Qwen2-shaped model (bf16, AdamW)."""
    from transformers import Qwen2ForCausalLM

    from xshard.runtime.throughput import ModelFlops

    device = torch_device(spec["device"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(spec))
    flops_per_token = ModelFlops.of(model, lambda p: p.numel()).per_token(spec["seq"])
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, spec["model"]["vocab"], (spec["micro_batch"], spec["seq"]),
                        generator=torch.Generator().manual_seed(1)).to(device)
    step, finish = build_trainer(cfg, model, device, spec["compile"])
    try:
        for _ in range(spec["warmup"]):
            step(ids)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(spec["steps"]):
            step(ids)
        synchronize(device)
        seconds = (time.perf_counter() - start) / spec["steps"]
        idle = idle_share(lambda: step(ids), device)
        memory = getattr(torch, device.type).max_memory_allocated(device) if device.type != "cpu" else None
    finally:
        finish()
    tokens = spec["micro_batch"] * spec["seq"] / seconds
    peak = spec.get("peak_tflops")
    return {"params": params, "step_s": round(seconds, 4), "tokens_per_s": round(tokens, 1),
            "tflops": round(tokens * flops_per_token / 1e12, 3),
            "mfu": round(tokens * flops_per_token / (peak * 1e12), 4) if peak else None,
            "idle_share": idle, "peak_memory_gib": round(memory / 2**30, 2) if memory else None}


def build_trainer(cfg: dict[str, Any], model: torch.nn.Module, device: torch.device,
                  compile_model: bool) -> tuple[Callable[[torch.Tensor], None], Callable[[], None]]:
    """(one training step on token ids, the clean-up) for ``cfg["impl"]``: plain, xshard, fsdp2, accelerate."""
    impl = cfg["impl"]
    dynamo = {"dynamo_backend": "inductor"} if compile_model else {}
    if impl in ("xshard", "accelerate"):
        if impl == "xshard":
            import xshard

            acc: Any = xshard.Accelerator(config={"stage": cfg["stage"], "mixed_precision": "bf16"}, **dynamo)
        else:
            from accelerate import Accelerator as HFAccelerator

            acc = HFAccelerator(mixed_precision="bf16", **dynamo)
        prepared, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step(ids: torch.Tensor) -> None:
            acc.backward(prepared(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()

        return step, (acc.end if impl == "xshard" else lambda: free_memory(device))
    autocast = impl == "plain"
    if impl == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            dist.init_process_group({"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo"), device_id=
                                    device if device.type != "cpu" else None)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if compile_model else model

    def plain_step(ids: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    def finish() -> None:
        if impl == "fsdp2":
            import torch.distributed as dist

            dist.destroy_process_group()
        free_memory(device)

    return plain_step, finish


# ------------------------------------------------------------------------------------------- checkpoints, offload
def mlp_trainer(spec: dict[str, Any], config: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """(the Accelerator, one training step) of the MLP through xshard with ``config``."""
    import xshard

    acc = xshard.Accelerator(config=config)
    model = make_model(spec["d"], spec["blocks"])
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(spec["batch"], spec["seq"], spec["d"], generator=torch.Generator().manual_seed(2)).to(acc.device)

    def step() -> None:
        acc.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()

    return acc, step


def timed_steps(step: Callable[[], None], device: torch.device, n: int) -> list[float]:
    """Each of ``n`` steps' wall time, the device drained after each."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def async_save(spec: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Stall of a save = (save call + the steps after it + the wait for it) - the same steps without a save."""
    from xshard.checkpoint.save_load import wait_for_background_save

    device = torch_device(spec["device"])
    acc, step = mlp_trainer(spec, {"stage": 3, "state_dict_type": "sharded", "mixed_precision": "bf16"})
    timed_steps(step, device, spec["warmup"])
    folder = Path(spec["tmp"]) / "checkpoints"
    stalls: dict[str, list[float]] = {"blocking": [], "async": []}
    for i in range(spec["repeats"]):
        for way in stalls:
            before = sum(timed_steps(step, device, spec["steps"]))
            start = time.perf_counter()
            acc.save_state(str(folder / f"{way}-{i}"), async_save=way == "async")
            timed_steps(step, device, spec["steps"])
            wait_for_background_save(acc.job)
            stalls[way].append(time.perf_counter() - start - before)
    acc.end()
    blocking, background = (statistics.median(stalls[w]) for w in ("blocking", "async"))
    return {"blocking_stall_s": round(blocking, 4), "async_stall_s": round(background, 4),
            "ratio": round(background / blocking, 3) if blocking > 0 else None,  # None: no blocking stall measured
            "stalls_s": stalls, "goal": 0.2}


def offload(spec: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Median step time of the MLP at stage 3 (bf16) with or without CPU offload; the copies' overlap."""
    device = torch_device(spec["device"])
    on = cfg["offload"]
    acc, step = mlp_trainer(spec, {"stage": 3, "mixed_precision": "bf16", "offload_params": on,
                                   "offload_optimizer": on})
    try:
        timed_steps(step, device, spec["warmup"])
        seconds = statistics.median(timed_steps(step, device, spec["steps"]))
        overlap = copy_overlap(step, device) if on else None
    finally:
        acc.end()
    return {"step_s": round(seconds, 4), "h2d_overlap": overlap}


PARTS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "correctness": correctness, "syncs": syncs, "speed": speed, "async_save": async_save, "offload": offload}


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of ``spec`` in turn, each result or its error by name."""
    results: dict[str, Any] = {}
    for cfg in spec["configs"]:
        start = time.perf_counter()
        try:
            results[cfg["name"]] = PARTS[spec["part"]](spec, cfg)
        except Exception as exc:  # recorded: the next configuration still runs
            results[cfg["name"]] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
        results[cfg["name"]]["seconds"] = round(time.perf_counter() - start, 2)
    return results
