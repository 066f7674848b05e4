"""Tiny random models of many transformers families, each with its task head and training rows (no hub).

``FAMILIES[name]()`` builds a ``Family``: the model from its config class at tiny sizes with every dropout at 0
(two runs then draw nothing differently), seeded; ``rows``: ``ROWS`` training examples (dicts of tensors of one
shape, so any collation gives the same batches) drawn from a fixed generator; and ``fixed``: the keyword
arguments every batch adds (CLIP's ``return_loss=True``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: training rows of each family (3 steps of a global batch of 4, and as many again)
ROWS = 24
VOCAB = 64
SEQ = 12
Rows = list[dict[str, torch.Tensor]]


@dataclass
class Family:
    """One family's tiny model, its training rows and the constant keyword arguments of its batches."""

    model: torch.nn.Module
    rows: Rows
    fixed: dict[str, Any] = field(default_factory=dict)

    def collate(self, rows: Rows) -> dict[str, Any]:
        """A batch of ``rows`` (stacked), with the family's fixed arguments."""
        return {**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}, **self.fixed}


def _no_dropout(config: Any) -> Any:
    """Every dropout and drop-path rate of ``config`` and its sub-configs set to 0."""
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in name or "drop_path" in name):
            setattr(config, name, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            _no_dropout(value)
    return config


def _build(model_class: type, config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_class(_no_dropout(config))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _images(size: int = 32) -> Rows:
    g = _generator()
    return [{"pixel_values": torch.randn(3, size, size, generator=g), "labels": torch.tensor(i % 3)}
            for i in range(ROWS)]


def _sentences(num_labels: int = 3) -> Rows:
    g = _generator()
    return [{"input_ids": torch.randint(2, VOCAB, (SEQ,), generator=g), "attention_mask": torch.ones(SEQ, dtype=torch.long),
             "labels": torch.tensor(i % num_labels)} for i in range(ROWS)]


def _causal() -> Rows:
    g = _generator()
    rows = []
    for _ in range(ROWS):
        ids = torch.randint(2, VOCAB, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.clone()})
    return rows


def _seq2seq() -> Rows:
    g = _generator()
    return [{"input_ids": torch.randint(2, VOCAB, (SEQ,), generator=g), "attention_mask": torch.ones(SEQ, dtype=torch.long),
             "labels": torch.randint(2, VOCAB, (6,), generator=g)} for _ in range(ROWS)]


# ---------------------------------------------------------------------------------------------- vision
def resnet() -> Family:
    import transformers as tf

    config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return Family(_build(tf.ResNetForImageClassification, config), _images())


def convnext() -> Family:
    import transformers as tf

    config = tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, patch_size=4)
    return Family(_build(tf.ConvNextForImageClassification, config), _images())


def vit() -> Family:
    import transformers as tf

    config = tf.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                          image_size=32, patch_size=8, num_labels=3)
    return Family(_build(tf.ViTForImageClassification, config), _images())


def swin() -> Family:
    import transformers as tf

    config = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4,
                           num_labels=3)
    return Family(_build(tf.SwinForImageClassification, config), _images())


# ---------------------------------------------------------------------------------------------- encoders
_ENCODER = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 32, "max_position_embeddings": 32, "num_labels": 3}


def bert() -> Family:
    import transformers as tf

    return Family(_build(tf.BertForSequenceClassification, tf.BertConfig(**_ENCODER)), _sentences())


def roberta() -> Family:
    import transformers as tf

    config = tf.RobertaConfig(**_ENCODER, pad_token_id=1)
    return Family(_build(tf.RobertaForSequenceClassification, config), _sentences())


def deberta_v2() -> Family:
    import transformers as tf

    config = tf.DebertaV2Config(**_ENCODER, pooler_hidden_size=16, position_buckets=8, max_relative_positions=16)
    return Family(_build(tf.DebertaV2ForSequenceClassification, config), _sentences())


# ---------------------------------------------------------------------------------------------- decoder LMs
_DECODER = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}


def _lm(config_name: str, model_name: str, **extra: Any) -> Callable[[], Family]:
    def build() -> Family:
        import transformers as tf

        config = getattr(tf, config_name)(**{**_DECODER, **extra})
        return Family(_build(getattr(tf, model_name), config), _causal())

    build.__name__ = model_name
    return build


_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


# ---------------------------------------------------------------------------------------------- encoder-decoders
def t5() -> Family:
    import transformers as tf

    config = tf.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                         decoder_start_token_id=0)
    return Family(_build(tf.T5ForConditionalGeneration, config), _seq2seq())


def bart() -> Family:
    import transformers as tf

    config = tf.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                           max_position_embeddings=32)
    return Family(_build(tf.BartForConditionalGeneration, config), _seq2seq())


def whisper() -> Family:
    import transformers as tf

    config = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                              encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                              decoder_ffn_dim=32, max_source_positions=16, max_target_positions=16,
                              decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              begin_suppress_tokens=None, suppress_tokens=None)
    g = _generator()
    rows = [{"input_features": torch.randn(8, 32, generator=g), "labels": torch.randint(3, VOCAB, (6,), generator=g)}
            for _ in range(ROWS)]
    return Family(_build(tf.WhisperForConditionalGeneration, config), rows)


# ---------------------------------------------------------------------------------------------- multimodal
_TOWER = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


def clip() -> Family:
    import transformers as tf

    config = tf.CLIPConfig(text_config={**_TOWER, "vocab_size": VOCAB, "max_position_embeddings": 16},
                           vision_config={**_TOWER, "image_size": 16, "patch_size": 8}, projection_dim=8)
    config.text_config.bos_token_id, config.text_config.eos_token_id, config.text_config.pad_token_id = 0, 1, 1
    g = _generator()
    rows = [{"input_ids": torch.randint(2, VOCAB, (SEQ,), generator=g),
             "pixel_values": torch.randn(3, 16, 16, generator=g)} for _ in range(ROWS)]
    return Family(_build(tf.CLIPModel, config), rows, {"return_loss": True})


def llava() -> Family:
    import transformers as tf

    image_token = VOCAB - 1
    vision = tf.CLIPVisionConfig(**_TOWER, image_size=16, patch_size=8)  # 4 patches (+ the class token, dropped)
    text = tf.LlamaConfig(**_DECODER)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                            vision_feature_layer=-1, projector_hidden_act="gelu")
    g = _generator()
    rows = []
    for _ in range(ROWS):
        ids = torch.cat([torch.full((4,), image_token), torch.randint(2, VOCAB - 1, (SEQ - 4,), generator=g)])
        labels = ids.clone()
        labels[:4] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels,
                     "pixel_values": torch.randn(3, 16, 16, generator=g)})
    return Family(_build(tf.LlavaForConditionalGeneration, config), rows)


#: family name -> builder of (model, training rows)
FAMILIES: dict[str, Callable[[], Family]] = {
    "resnet": resnet, "convnext": convnext, "vit": vit, "swin": swin,
    "bert": bert, "roberta": roberta, "deberta_v2": deberta_v2,
    "llama": _lm("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": _lm("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "qwen3_moe": _lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=8, **_MOE),
    "mixtral": _lm("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "gemma": _lm("GemmaConfig", "GemmaForCausalLM", head_dim=8),
    "phi": _lm("PhiConfig", "PhiForCausalLM"),
    "t5": t5, "bart": bart, "whisper": whisper,
    "clip": clip, "llava": llava,
}
