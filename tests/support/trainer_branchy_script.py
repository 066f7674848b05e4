"""A tiny LLaVA trained with the transformers Trainer on a data set that mixes image and text-only samples.

Run on 2 processes, stock (``SFT_TRAINER=stock``, under torchrun on Accelerate's DDP with
``ddp_find_unused_parameters=True``) or on xshard (``SFT_TRAINER=xshard``, under ``xshard launch``, the same
arguments plus ``deepspeed=`` a ZeRO-3 ds_config full of "auto")::

    xshard launch --nproc 2 tests/support/trainer_branchy_script.py OUT

The samples are read in order (``train_sampling_strategy="sequential"``, 2 per rank and step: rank 0 reads
samples 4s and 4s+1 at step s, rank 1 samples 4s+2 and 4s+3), and ``PATTERN`` says which have an image: at
step 0 only rank 0's batch has images, at step 1 only rank 1's (one image beside a text-only sample), at step 2
no rank's, at step 3 both. The collator stacks the images a batch has and gives no ``pixel_values`` to an
all-text batch, so LLaVA runs its vision tower (and projector) on some ranks only, or on none.

Each rank writes ``OUT/batches-RANK.json``: per batch it collated, the sample indices and how many images it
had. Rank 0 writes ``OUT/figures.json``: {"model_class", "losses", "grad_norms"} (the Trainer's log lines).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

STEPS = 4
PER_DEVICE = 2
VOCAB, SEQ, PATCHES = 64, 12, 4
IMAGE_TOKEN = VOCAB - 1
#: per step, per rank, whether each of its two samples has an image
PATTERN = [
    [(True, True), (False, False)],   # the vision tower on rank 0 only
    [(False, False), (True, False)],  # on rank 1 only, beside a text-only sample
    [(False, False), (False, False)],  # on no rank
    [(True, False), (True, True)],    # on both
]
DS_CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto"}


def build_model() -> torch.nn.Module:
    """A LLaVA of a 2-layer CLIP vision tower and a 2-layer Llama, every dropout 0, seeded."""
    import transformers as tf

    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision = tf.CLIPVisionConfig(**tower, image_size=16, patch_size=8, attention_dropout=0.0, dropout=0.0)
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                          attention_dropout=0.0)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                            vision_feature_layer=-1, projector_hidden_act="gelu")
    torch.manual_seed(0)
    return tf.LlavaForConditionalGeneration(config)


def rows() -> list[dict[str, Any]]:
    """The samples in ``PATTERN``'s order: an image one starts with its 4 image tokens (not in the labels)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    flags = [has for step in PATTERN for rank in step for has in rank]
    for index, has_image in enumerate(flags):
        text = torch.randint(2, VOCAB - 1, (SEQ - PATCHES if has_image else SEQ,), generator=g)
        ids = torch.cat([torch.full((PATCHES,), IMAGE_TOKEN), text]) if has_image else text
        labels = ids.clone()
        labels[ids == IMAGE_TOKEN] = -100
        row = {"index": index, "input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels}
        if has_image:
            row["pixel_values"] = torch.randn(3, 16, 16, generator=g)
        out.append(row)
    return out


class Collator:
    """Stacks the text of every sample and the images of those that have one; an all-text batch gets no
    ``pixel_values``. Records what each batch held."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "attention_mask", "labels")}
        images = [s["pixel_values"] for s in samples if "pixel_values" in s]
        if images:
            batch["pixel_values"] = torch.stack(images)
        self.batches.append({"indices": [s["index"] for s in samples], "images": len(images)})
        return batch


def main(out: Path) -> None:
    impl = os.environ.get("SFT_TRAINER", "xshard")
    if impl == "xshard":
        from xshard.trainer import Trainer, TrainingArguments
        extra: dict[str, Any] = {"deepspeed": DS_CONFIG}
    else:
        from transformers import Trainer, TrainingArguments
        extra = {}
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=PER_DEVICE, max_steps=STEPS,
                             logging_steps=1, save_strategy="no", learning_rate=1e-2, lr_scheduler_type="constant",
                             max_grad_norm=1.0, report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
                             train_sampling_strategy="sequential", remove_unused_columns=False,
                             ddp_find_unused_parameters=True, **extra)
    collator = Collator()
    model = build_model()
    trainer = Trainer(model=model, args=args, train_dataset=rows(), data_collator=collator)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    (out / f"batches-{rank}.json").write_text(json.dumps(collator.batches))
    if rank == 0:
        lines = [line for line in trainer.state.log_history if "loss" in line and "train_runtime" not in line]
        figures = {"model_class": type(model).__name__, "losses": [line["loss"] for line in lines],
                   "grad_norms": [line["grad_norm"] for line in lines]}
        (out / "figures.json").write_text(json.dumps(figures, indent=1))
    print("branchy: done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
