#!/usr/bin/env bash
# The same Trainer fine-tune, offline, on 2 CPU processes: with no --model_name_or_path and no --data_path,
# finetune.py builds a tiny random Qwen2 and a Qwen-style tokenizer and uses data/alpaca_synthetic.json.
#   bash run_tiny_cpu.sh     (the loss starts near ln(576) = 6.4, the tiny vocabulary's chance level, and falls)
set -euo pipefail
cd "$(dirname "$0")"
OUTPUT=${OUTPUT:-${TMPDIR:-/tmp}/xshard-tiny-qwen/output}
XSHARD_BACKEND=cpu torchrun --standalone --nproc_per_node=2 finetune.py \
    --deepspeed ds_config_zero3.json \
    --output_dir "$OUTPUT" \
    --max_steps 60 \
    --per_device_train_batch_size 4 \
    --model_max_length 256 \
    --save_strategy "steps" \
    --save_steps 30 \
    --save_total_limit 1 \
    --learning_rate 3e-3 \
    --warmup_ratio 0.03 \
    --lr_scheduler_type "cosine" \
    --seed 1234 \
    --logging_steps 5
# The own-loop version takes the same arguments: finetune_loop.py instead of finetune.py
