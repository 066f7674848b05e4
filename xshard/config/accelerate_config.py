"""The config of a script written for Accelerate: where it comes from, and the ``"auto"`` values a ds_config gets.

An ``Accelerator(...)`` reads its config once (``read_config_source``): the ``config`` argument, else a
``DeepSpeedPlugin``'s ``hf_ds_config`` (a ds_config by the user's word, never told from its keys). A ds_config's
``"auto"`` entries are filled as Accelerate fills them (``auto_values``): accumulation and clipping from the
Accelerator's arguments (clipping 1.0 unless a DeepSpeedPlugin or ``ACCELERATE_GRADIENT_CLIPPING`` says
otherwise), bf16/fp16 from ``mixed_precision``; the micro-batch waits for the first prepared data loader.
"""

from __future__ import annotations

import os
from typing import Any

from .accelerate_args import AccelerateSettings, settle_with_config
from .auto import LATER, ScriptValues, resolve_auto
from .precision_names import MIXED_PRECISION
from .schema import XShardConfig, read_source
from .source import ConfigKind, ConfigSource

#: why a ds_config's optimizer/scheduler "auto" values have no source under an Accelerate script, and the fix
NO_SCRIPT_OPTIMIZER_VALUES = (
    "An Accelerate script builds and prepares its own optimizer and scheduler, which is what trains: remove the "
    "ds_config's \"optimizer\" and \"scheduler\" blocks (Accelerate refuses them beside the script's own too, "
    "unless it gets a DummyOptim/DummyScheduler)."
)


def read_config_source(config: Any, settings: AccelerateSettings) -> ConfigSource:
    """The job's config source, read once: ``config``, else a DeepSpeedPlugin's ``hf_ds_config``."""
    if config is None and settings.ds_config is not None:
        return read_source(settings.ds_config, os.environ, kind=ConfigKind.DEEPSPEED)
    return read_source(config, os.environ)


def load_config(source: ConfigSource, overrides: dict[str, Any], settings: AccelerateSettings) -> XShardConfig:
    """The ``XShardConfig`` of ``source`` with the Accelerator's ``overrides``; a ds_config's "auto" values filled."""
    if source.kind is ConfigKind.OBJECT and not overrides:
        return settle_with_config(settings, source.config)  # an XShardConfig the script built itself
    script_args = auto_values(settings) if source.configured_by_deepspeed else None
    config = XShardConfig.load(source, overrides=overrides or None, env=os.environ, script_args=script_args)
    return settle_with_config(settings, config)  # what depends on the stage (a DDP comm_hook)


def auto_values(settings: AccelerateSettings) -> ScriptValues:
    """Values for a ds_config's ``"auto"`` entries, filled as Accelerate fills them (see the module docstring)."""
    values = ScriptValues(settings.script_args, missing_fix=NO_SCRIPT_OPTIMIZER_VALUES)
    # an unknown spelling is the config's error to report (it reads the same value): neither here
    precision = MIXED_PRECISION.get(str(settings.overrides.get("mixed_precision", "no")).strip().lower())
    values.setdefault("bf16", precision == "bf16")
    values.setdefault("fp16", precision == "fp16")
    values.setdefault("max_grad_norm", float(os.environ.get("ACCELERATE_GRADIENT_CLIPPING", 1.0)))
    values["per_device_train_batch_size"] = LATER
    return values


def resolved_ds_config(settings: AccelerateSettings, ds_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ds_config with its ``"auto"`` values filled (``auto_values``), or None."""
    return None if ds_config is None else resolve_auto(ds_config, auto_values(settings), os.environ)
