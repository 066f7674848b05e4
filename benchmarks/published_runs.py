"""xshard's planning figures beside published runs: ``xshard estimate``'s memory and ``xshard.step_time``'s step
time, each with its source and the assumptions that produce it, as ratios (predicted / published).

    python benchmarks/published_runs.py

No device is used: this checks the planning model's arithmetic and assumptions against figures other
projects measured on their machines. The figures:

1. torchtitan, Llama 3.1 8B on 8 x H100 (FSDP, bf16, sequence 8192): 5,762 tokens/s per GPU, 33-39% MFU
   (torchtitan's published benchmarks). Our step time is compute-bound there, so its tokens/s follow from
   the FLOPs formula at the MFU assumed: printed at the published MFU range's ends and at the default 0.40.
2. DeepSpeed's memory documentation, "bigscience/T0_3B" (2,851M parameters) on 8 GPUs, model states only,
   as DeepSpeed's estimators print them (GB there means 2^30 bytes): ZeRO-2 15.93, ZeRO-2 with the optimizer
   offloaded 5.31, ZeRO-3 6.10 per GPU. DeepSpeed's ZeRO-2 keeps the fp16 parameters and a full fp16
   gradient buffer on every GPU (4 bytes a parameter) and 16/N of fp32 gradients and Adam; xshard's stage 2
   reduce-scatters each gradient as it is ready and keeps only its shard (2 + 2/N + 12/N). So the rows give
   DeepSpeed's own formula (checks the reading of the figures) and xshard's estimate of the same count,
   whose ratio is the memory xshard's layout saves, not an error.
"""

from __future__ import annotations

from xshard.estimate import ModelSize, estimate_memory
from xshard.step_time import MACHINES, predict

GIB = 2**30


def llama31_8b() -> ModelSize:
    """Llama 3.1 8B's shape (its config.json): 32 layers, d 4096, FFN 14336, GQA 32/8 heads, vocab 128256."""
    h, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 8 * 128
    layer = h * h + 2 * h * kv + h * h + 3 * h * inter + 2 * h
    root = 2 * vocab * h + h
    return ModelSize(total_params=root + layers * layer, root_params=root, largest_layer_params=layer,
                     num_layers=layers, hidden_size=h, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=inter, vocab_size=vocab, model_type="llama", architecture="LlamaForCausalLM",
                     source="Llama 3.1 8B config.json")


def t0_3b() -> ModelSize:
    """bigscience/T0_3B as DeepSpeed's example counts it (2,851M parameters; T5-XL: d 1024, 24 + 24 layers, FFN
    16384, vocab 32128, 32 heads of 128). Only the count and the largest layer enter the model states."""
    h, inter, heads = 1024, 16384, 32
    layer = 3 * (h * heads * 128 + 3 * h * heads * 128) // 2 + 2 * h * inter  # a decoder layer: self + cross attn
    return ModelSize(total_params=2_851_000_000, root_params=32128 * h, largest_layer_params=layer, num_layers=48,
                     hidden_size=h, num_heads=heads, num_kv_heads=heads, head_dim=128, intermediate_size=inter,
                     vocab_size=32128, model_type="t5", architecture="T5ForConditionalGeneration",
                     source="DeepSpeed's memory documentation")


def main() -> None:
    rows: list[tuple[str, float, float, str]] = []
    llama = llama31_8b()
    for mfu in (0.33, 0.39, 0.40):
        t = predict(llama, 3, 8, MACHINES["h100"], seq_len=8192, mfu=mfu)
        rows.append((f"Llama 3.1 8B, 8 x H100, tokens/s per GPU (MFU {mfu:.2f} assumed, {t.bound}-bound)",
                     t.tokens_per_s_per_device, 5762.0, "torchtitan benchmarks: 5,762 tokens/s/GPU, 33-39% MFU"))

    psi, n = 2_851_000_000, 8
    rows.append(("T0_3B ZeRO-2, 8 GPUs: DeepSpeed's formula 4 + 16/N bytes", psi * (4 + 16 / n) / GIB, 15.93,
                 "DeepSpeed docs: estimate_zero2_model_states_mem_needs_all_live"))
    rows.append(("T0_3B ZeRO-2 + optimizer offload: DeepSpeed's formula 2 bytes", psi * 2 / GIB, 5.31,
                 "DeepSpeed docs (offload_optimizer=cpu)"))
    t0 = t0_3b()
    for stage, published, note in ((2, 15.93, "xshard keeps the gradient shard only"),
                                    (3, 6.10, "xshard: 16/N a parameter + the gathered units")):
        e = estimate_memory(t0, n, stage, "bf16")
        states = (e.params + e.grads + e.optimizer + e.gathered) / GIB
        rows.append((f"T0_3B stage {stage}, 8 GPUs: xshard estimate, model states ({note})", states, published,
                     "DeepSpeed docs"))
    e = estimate_memory(t0, n, 2, "bf16", offload=True)
    rows.append(("T0_3B stage 2 + offload, 8 GPUs: xshard estimate, device model states",
                 (e.params + e.grads + e.optimizer + e.gathered) / GIB, 5.31, "DeepSpeed docs"))

    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'xshard':>10}  {'published':>10}  {'ratio':>6}  source")
    for label, ours, published, source in rows:
        print(f"{label:<{width}}  {ours:>10.2f}  {published:>10.2f}  {ours / published:>6.2f}  {source}")


if __name__ == "__main__":
    main()
