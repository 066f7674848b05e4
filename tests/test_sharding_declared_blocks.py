"""The default units are the block classes of the model's ``_no_split_modules`` that the model has.

A composite model lists its towers' blocks, some of which it never builds: LLaVA's list names CLIP's text
embeddings, which its vision tower has not, and ``prepare()`` refused the model naming that class. A class the
user names in ``transformer_layer_cls_to_wrap`` and the model lacks is still an error.
"""

from __future__ import annotations

import pytest
from support.model_zoo import FAMILIES

from xshard.sharding import ShardingOptions, shard_model


def test_a_composite_models_declared_blocks_it_lacks_are_left_out(cpu_backend) -> None:
    model = FAMILIES["llava"]().model
    assert "CLIPTextEmbeddings" in model._no_split_modules  # declared, never built
    sm = shard_model(model, cpu_backend, ShardingOptions())
    units = {type(u.module).__name__ for u in sm.units}
    assert {"CLIPEncoderLayer", "LlamaDecoderLayer", "CLIPVisionEmbeddings"} <= units


def test_a_block_class_the_user_names_and_the_model_lacks_is_still_an_error(cpu_backend) -> None:
    model = FAMILIES["llava"]().model
    with pytest.raises(ValueError, match="names \\['CLIPTextEmbeddings'\\], but no module of the model has"):
        shard_model(model, cpu_backend, ShardingOptions(transformer_layer_cls_to_wrap=["CLIPTextEmbeddings"]))
