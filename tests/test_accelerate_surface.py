"""The names and members Accelerate scripts reach, on xshard.

- ``xshard.logging.get_logger`` takes Accelerate's ``main_process_only`` / ``in_order`` on 2 processes,
  and Accelerate's own ``accelerate.logging.get_logger`` works beside an xshard Accelerator (its
  ``PartialState`` is filled with the job's facts, ``xshard.state.share_with_accelerate``);
- ``from xshard import DistributedType`` (and Accelerate's other top-level names that mean something
  here); the others, and Accelerate's ``Accelerator`` members xshard lacks, raise ``AttributeError``
  naming xshard's way;
- ``dataloader_config``, ``join_uneven_inputs``, pickling (the same Accelerator back in this process;
  a clear error in another).
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
from pathlib import Path

import pytest
from support.jobs import run_job

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
def test_loggers_follow_main_process_only_and_in_order_on_2_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = run_job([sys.executable, "-m", "xshard", "launch", "--nproc", "2",
                    str(Path(__file__).parent / "support" / "accelerate_logging_script.py")],
                   timeout=270, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for name in ("from_accelerate", "from_xshard"):
        lines = [line for line in out.splitlines() if name in line]
        said = {words for line in lines for words in [line.split(name, 1)[1]]}
        assert any("main-only 0" in w for w in said) and not any("main-only 1" in w for w in said), name
        assert any("everyone 0" in w for w in said) and any("everyone 1" in w for w in said), name
        order = [w for w in said for r in (0, 1) if f"in-order {r}" in w]
        assert len(order) == 2, name
        assert sum("once 0" in line for line in lines) == 1, name
    ordered = [line for line in out.splitlines() if "in-order" in line and "from_xshard" in line]
    assert ["in-order 0" in ordered[0], "in-order 1" in ordered[1]] == [True, True]  # rank order
    # without the keywords xshard's per-process levels apply: replicas warn, only the main process informs
    assert "default-warning 1" in out and "default-info 0" in out and "default-info 1" not in out


def test_accelerates_top_level_names_import_from_xshard():
    from xshard import (
        DataLoaderConfiguration,
        DistributedType,
        GradScalerKwargs,
        set_seed,
        skip_first_batches,
    )
    from xshard.utils import DistributedType as FromUtils

    assert DistributedType is FromUtils and DistributedType.MULTI_CPU == "MULTI_CPU"
    assert callable(set_seed) and callable(skip_first_batches)
    assert DataLoaderConfiguration().even_batches and GradScalerKwargs().enabled
    import xshard

    with pytest.raises(AttributeError, match=r"init_empty_weights.*accelerator.sharded_init\(\)"):
        xshard.init_empty_weights  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        xshard.no_such_name  # noqa: B018


@pytest.fixture(scope="module")
def accelerator():
    import xshard

    acc = xshard.Accelerator(backend="cpu", stage=0)
    yield acc
    acc.end()


def test_missing_accelerate_members_name_xshards_way(accelerator):
    with pytest.raises(AttributeError, match=r"Accelerator.lomo_backward is Accelerate's.*accelerator.backward"):
        accelerator.lomo_backward  # noqa: B018
    with pytest.raises(AttributeError, match=r"register_save_state_pre_hook.*register_for_checkpointing"):
        accelerator.register_save_state_pre_hook  # noqa: B018
    with pytest.raises(AttributeError, match="'Accelerator' object has no attribute 'no_such_member'"):
        accelerator.no_such_member  # noqa: B018
    assert not hasattr(accelerator, "fp8_backend")


def test_dataloader_config_and_join_uneven_inputs(accelerator):
    config = accelerator.dataloader_config
    assert (config.split_batches, config.even_batches, config.dispatch_batches) == (False, True, False)
    assert accelerator.use_stateful_dataloader and not accelerator.dispatch_batches
    ran = []
    with accelerator.join_uneven_inputs([], even_batches=True):
        ran.append(True)
    assert ran == [True]


def test_pickling_gives_this_processs_accelerator_back(accelerator):
    assert pickle.loads(pickle.dumps(accelerator)) is accelerator
    assert copy.deepcopy({"acc": accelerator})["acc"] is accelerator
    from xshard import accelerator as module

    payload = pickle.dumps(accelerator)
    token = accelerator._token
    del module._LIVE[token]  # as in another process, where this Accelerator does not exist
    try:
        with pytest.raises(RuntimeError, match="unpickled in another process.*process_index"):
            pickle.loads(payload)
    finally:
        module._LIVE[token] = accelerator
