"""Turn an xshard checkpoint (full, sharded or local) into one state dict, without a process group.

    xshard consolidate out/checkpoint-100 model.safetensors      # one safetensors file
    xshard consolidate out/checkpoint-100 ./export                # a folder: model.safetensors, and the
                                                                  # config.json of a transformers model,
                                                                  # so that from_pretrained loads it

OUT ending in ``.safetensors`` is that file; any other OUT is a folder. Every file is checked
against the checkpoint's manifest (size and checksum) while it is read. An existing output is refused
unless ``--overwrite`` is given (the new file is written beside it and renamed in).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder written by Accelerator.save_state")
    parser.add_argument("out", help="a file name ending in .safetensors, or a folder (model.safetensors and, for a "
                                    "transformers model, config.json)")
    parser.add_argument("--model-index", type=int, default=0,
                        help="which prepared model, for jobs that prepared several (default: 0)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output file (written beside it, then renamed in)")


def run(args: argparse.Namespace) -> int:
    from xshard.checkpoint.consolidate import consolidate

    written = consolidate(args.checkpoint, args.out, args.model_index, overwrite=args.overwrite)
    print(f"wrote {written}")
    return 0
