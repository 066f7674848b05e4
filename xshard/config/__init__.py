"""Configuration: one validated ``XShardConfig``, read from the files users already have.

- ``schema``: the ``XShardConfig`` fields, their validation, precedence (overrides > ``XSHARD_*`` >
  file > defaults) and file-kind detection;
- ``deepspeed``, ``fsdp``: readers of DeepSpeed ``ds_config.json``, accelerate FSDP yaml and the HF
  Trainer's ``--fsdp`` words; ``auto``: DeepSpeed/Trainer ``"auto"`` values from the script's arguments;
- ``values``: value parsers shared by all readers (errors name the key, the value and the choices);
- ``precision``: the one table of precision and dtype spellings every reader asks;
- ``render``: the documented YAML that ``xshard config`` writes.
"""

from .schema import XShardConfig, parse_text, read_file
from .values import XShardConfigError, XShardConfigWarning

__all__ = ["XShardConfig", "XShardConfigError", "XShardConfigWarning", "parse_text", "read_file"]
