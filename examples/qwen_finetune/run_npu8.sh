#!/usr/bin/env bash
# The openMind guide's Qwen1.5-7B-Chat Alpaca fine-tune on 8 Ascend NPUs, run on xshard.
# The guide's Trainer script (finetune.py) with the guide's exact arguments; DeepSpeed's config file is read by
# xshard (no DeepSpeed needed), and --evaluation_strategy / --warmup_ratio, the transformers 4 names the guide
# uses, are read by xshard's TrainingArguments as --eval_strategy / --warmup_steps (a ratio below 1).
#   MODEL=/path/to/qwen1.5_7b_chat DATA=/path/to/alpaca_data.json bash run_npu8.sh
# MODEL is a local folder (the run is offline). finetune.py loads it with from_pretrained on every rank, as the
# guide does; finetune_loop.py (same arguments) reads only each rank's shard of the weights.
# Check the memory first:  xshard estimate --model "$MODEL" --nproc 8 --stage 3 --device-memory 64GB
# Same run with xshard's launcher:  XSHARD_BACKEND=npu xshard launch --nproc 8 finetune.py <the arguments below>
# Resume after an interruption: add  --resume_from_checkpoint True  (the latest complete checkpoint in OUTPUT)
set -euo pipefail
cd "$(dirname "$0")"
MODEL=${MODEL:-PyTorch-NPU/qwen1.5_7b_chat}
DATA=${DATA:-alpaca_data.json}
DS_CONFIG=${DS_CONFIG:-ds_config_zero3.json}
OUTPUT=${OUTPUT:-./test/output}

mkdir -p "$OUTPUT"

# (The guide's own script has `"PyTorch-NPU/qwen1.5_7b_chat"\` with no space before the backslash,
# which glues --data_path onto the model name; every line below ends in " \".)
torchrun --nproc_per_node=8 --master_port="${MASTER_PORT:-29500}" finetune.py \
    --model_name_or_path "$MODEL" \
    --data_path "$DATA" \
    --deepspeed "$DS_CONFIG" \
    --bf16 True \
    --output_dir "$OUTPUT" \
    --max_steps 2000 \
    --per_device_train_batch_size 1 \
    --evaluation_strategy "no" \
    --save_strategy "steps" \
    --save_steps 3000 \
    --save_total_limit 1 \
    --learning_rate 1e-6 \
    --weight_decay 0. \
    --warmup_ratio 0.03 \
    --lr_scheduler_type "cosine" \
    --seed 1234 \
    --logging_steps 1 > "$OUTPUT/train.log" 2>&1
