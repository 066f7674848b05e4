"""Configuration: one validated ``XShardConfig``, read from the files users already have.

- ``source``: the one reader of a config source: the file parsed once, and the record of its kind
  (xshard's, a DeepSpeed ds_config, an accelerate yaml, an HF fsdp_config) that everything else asks;
- ``schema``: the ``XShardConfig`` fields, their validation and precedence (overrides > ``XSHARD_*`` >
  file > defaults);
- ``deepspeed``, ``fsdp``: readers of DeepSpeed ``ds_config.json``, accelerate FSDP yaml and the HF
  Trainer's ``--fsdp`` words; ``auto``: DeepSpeed/Trainer ``"auto"`` values from the script's arguments;
- ``values``: value parsers shared by all readers (errors name the key, the value and the choices);
- ``precision``: the one table of precision and dtype spellings every reader asks;
- ``render``: the documented YAML that ``xshard config`` writes.
"""

from .schema import XShardConfig, read_file, read_source
from .source import ConfigKind, ConfigSource, parse_text
from .values import XShardConfigError, XShardConfigWarning

__all__ = ["ConfigKind", "ConfigSource", "XShardConfig", "XShardConfigError", "XShardConfigWarning", "parse_text",
           "read_file", "read_source"]
