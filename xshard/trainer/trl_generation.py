"""TRL's ``unwrap_model_for_generation`` on xshard: generation gathers through the sharded model's ``generate``.

TRL's GRPO (and its other online trainers) generate inside ``unwrap_model_for_generation(model, accelerator,
gather_deepspeed3_params=args.ds3_gather_for_generation)``. Through ``TrainerMixin`` the accelerator has no
DeepSpeed plugin (a ZeRO-3 ds_config included), so TRL yields the unwrapped model as it is and the sharded
model's ``generate`` gathers it once for the call (``xshard/sharding/generation.py``), as TRL's own gather
would under DeepSpeed. The user's ``ds3_gather_for_generation=False`` (TRL's "less memory, slower") is kept
by moving it to xshard's ``generate_gathers_once``: per unit and step, unless the config sets that field.
"""

from __future__ import annotations

from typing import Any


def route_trl_generation(args: Any, accelerator: Any) -> None:
    """Carry a TRL config's ``ds3_gather_for_generation=False`` over to xshard's ``generate_gathers_once``."""
    gather = getattr(args, "ds3_gather_for_generation", None)
    if gather is False and accelerator.config.generate_gathers_once == "auto":
        accelerator.config.generate_gathers_once = False
