"""Turn an xshard checkpoint (sharded, local or full) into one state dict, without a process group.

    xshard consolidate out/checkpoint-100 model.safetensors      # one safetensors state dict
    xshard consolidate out/checkpoint-100 ./export                # a transformers model: a folder
                                                                  # that from_pretrained loads

When the checkpoint holds the model's ``config.json`` (transformers models), OUT is a folder with
``config.json`` and ``model.safetensors``; otherwise OUT is the ``.safetensors`` file. Every file is
checked against the checkpoint's manifest (size, sha256) while it is read.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder written by Accelerator.save_state")
    parser.add_argument("out", help="the .safetensors file to write, or the folder for a transformers model")
    parser.add_argument("--model-index", type=int, default=0,
                        help="which prepared model, for jobs that prepared several (default: 0)")


def run(args: argparse.Namespace) -> int:
    from xshard.checkpoint.consolidate import consolidate

    written = consolidate(args.checkpoint, args.out, args.model_index)
    print(f"wrote {written}")
    return 0
