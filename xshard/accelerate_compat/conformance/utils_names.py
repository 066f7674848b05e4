"""``accelerate.utils``' names and what ``xshard.utils`` does with each (``UTILS_ROWS``).

The surface: ``accelerate.utils`` has no ``__all__``, so it is every public name that is not a submodule (what
``from accelerate.utils import X`` finds; ``installed``). The names xshard has are compared with Accelerate's in
``tests/test_accelerate_members.py``; the others (``missing.UTILS_NAMES``) raise an ImportError naming
xshard's way.
"""

from __future__ import annotations

from ..missing import UTILS_NAMES
from . import Row

NAMES = "test_accelerate_members.py::test_utils_names_match_accelerate"
REFUSED = "test_accelerate_conformance.py::test_every_refused_member_names_xshards_way"


def _rows(how: str, *names: str) -> dict[str, Row]:
    return {name: Row("same", how, NAMES) for name in names}


UTILS_ROWS: dict[str, Row] = {
    **_rows("Accelerate's fields and defaults; the Accelerator reads them (and Accelerate's own objects)",
            "AutocastKwargs", "DataLoaderConfiguration", "DeepSpeedPlugin", "DistributedDataParallelKwargs",
            "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
            "InitProcessGroupKwargs", "ProfileKwargs", "ProjectConfiguration"),
    **_rows("Accelerate's names and values", "DDPCommunicationHookType", "LoggerType", "PrecisionType"),
    "DistributedType": Row("different", "Accelerate's values for the kinds xshard runs, and its own MULTI_TPU "
                                        "(TorchTPU) and MULTI_MPS", NAMES),
    "set_seed": Row("same", "seeds random, numpy, torch and the device (the same draws)", NAMES),
    "send_to_device": Row("same", "moves tensors inside nested data", NAMES),
    "release_memory": Row("same", "drops the references and collects garbage; one None per object", NAMES),
    "tqdm": Row("same", "a progress bar on the main process only", NAMES),
    **{name: Row("refused", way, REFUSED) for name, way in UTILS_NAMES.items()},
}
