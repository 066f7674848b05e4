"""A Seq2SeqTrainer script as its users write it: a (tiny, random, offline) T5 trains on pairs of token ids,
evaluates with ``predict_with_generate`` during training and predicts after it. The only line that differs
between the stock run and the xshard run is the import, chosen by ``SEQ2SEQ_TRAINER=stock|xshard``::

    xshard launch --nproc 2 tests/support/seq2seq_script.py --output_dir out --max_steps 4 ...
    python -m torch.distributed.run --nproc_per_node 2 tests/support/seq2seq_script.py --use_cpu true ...

The main process writes ``predictions.json``: the generated tokens of ``predict()``, its metrics and the
training log.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers

VOCAB = 48


def tiny_t5() -> Any:
    """A tiny random T5 (its weights from a fixed seed; large enough to generate varied tokens)."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_ff=24, d_kv=8, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                   initializer_factor=8.0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(config)


def pairs(n: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` examples: 7 source tokens, their first 5 reversed as the target."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        source = torch.randint(2, VOCAB, (7,), generator=g).tolist()
        out.append({"input_ids": source, "attention_mask": [1] * 7, "labels": source[:5][::-1]})
    return out


def main() -> None:
    if os.environ.get("SEQ2SEQ_TRAINER", "xshard") == "stock":
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    else:
        from xshard.trainer import Seq2SeqTrainer, Seq2SeqTrainingArguments
    (args,) = transformers.HfArgumentParser(Seq2SeqTrainingArguments).parse_args_into_dataclasses()
    trainer = Seq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=pairs(32, 1), eval_dataset=pairs(6, 2))
    trainer.train()
    result = trainer.predict(pairs(6, 2))
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "predictions.json"), "w") as f:
            json.dump({"tokens": result.predictions.tolist(), "metrics": result.metrics,
                       "log": trainer.state.log_history}, f)


if __name__ == "__main__":
    main()
