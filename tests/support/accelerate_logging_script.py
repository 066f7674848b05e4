"""Logs the way Accelerate scripts do, through ``xshard.logging`` and ``accelerate.logging`` beside an xshard Accelerator.

Every line names the logger's source and the rank that wrote it; the test reads which ranks wrote what.
"""

from __future__ import annotations

import logging

from accelerate.logging import get_logger as accelerate_get_logger

import xshard
from xshard.logging import get_logger

logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
accelerate_log = accelerate_get_logger("from_accelerate")
xshard_log = get_logger("from_xshard")
accelerator = xshard.Accelerator(stage=0)
rank = accelerator.process_index
for log in (accelerate_log, xshard_log):
    log.info(f"main-only {rank}")
    log.info(f"everyone {rank}", main_process_only=False)
    log.info(f"in-order {rank}", in_order=True)
    log.warning_once(f"once {rank}")
    log.warning_once(f"once {rank}")
xshard_log.warning(f"default-warning {rank}")
xshard_log.info(f"default-info {rank}")
accelerator.end()
