"""Progress bars of slow file work (save, load, consolidation, sharded loading): drawn by the main process
on a terminal once the operation is slow; never on replicas, never into a log file (a non-terminal)."""

from __future__ import annotations

import io
import sys

import pytest
from support.distributed import run_workers
from test_checkpoint import _job, _steps

pytestmark = pytest.mark.multiprocess


class Terminal(io.StringIO):
    """What tqdm takes for a terminal."""

    def isatty(self) -> bool:
        return True


def _captured(stream, action):
    """What ``action`` writes to sys.stderr (tqdm's stream) while ``stream`` stands in for it."""
    old, sys.stderr = sys.stderr, stream
    try:
        action()
    finally:
        sys.stderr = old
    return stream.getvalue()


def _worker(rank, world_size, root, pretrained):
    from transformers import AutoModelForCausalLM

    from xshard.checkpoint import progress
    from xshard.pretrained import from_pretrained_sharded

    acc, model, opt, loader, sched = _job(world_size)
    _steps(acc, model, opt, loader, sched, 1)
    progress.SLOW_AFTER_S = 600.0  # no operation here takes that long: none is slow
    out = {"quick": _captured(Terminal(), lambda: acc.save_state(f"{root}/quick"))}
    progress.SLOW_AFTER_S = 0.0  # every operation counts as slow from here on
    out["terminal"] = _captured(Terminal(), lambda: (acc.save_state(f"{root}/ckpt"), acc.load_state(f"{root}/ckpt"),
                                                     from_pretrained_sharded(AutoModelForCausalLM, pretrained, acc)))
    out["log_file"] = _captured(io.StringIO(), lambda: (acc.save_state(f"{root}/ckpt2"), acc.load_state(f"{root}/ckpt2"),
                                                        from_pretrained_sharded(AutoModelForCausalLM, pretrained, acc)))
    return out


def test_bars_on_the_main_process_on_a_terminal_only(tmp_path, monkeypatch):
    from test_pretrained_loading import save

    from xshard.checkpoint import progress
    from xshard.checkpoint.consolidate import consolidate
    from xshard.runtime.rank_logging import setup_logging

    pretrained = save(tmp_path / "qwen", tie=False)
    main, replica = run_workers(_worker, 2, str(tmp_path), str(pretrained))
    assert main["quick"] == ""  # an operation quicker than SLOW_AFTER_S draws nothing
    for desc in ("saving ckpt", "loading ckpt", "loading qwen"):
        assert desc in main["terminal"], (desc, main["terminal"])
    assert "B/s" in main["terminal"]  # bytes, with a rate
    assert main["log_file"] == ""  # not a terminal: nothing, even when slow
    assert replica == {"quick": "", "terminal": "", "log_file": ""}  # replicas stay quiet

    setup_logging(0, 0, 1)
    monkeypatch.setattr(progress, "SLOW_AFTER_S", 0.0)
    shown = _captured(Terminal(), lambda: consolidate(tmp_path / "ckpt", tmp_path / "export.safetensors"))
    assert "reading ckpt" in shown and "writing export.safetensors" in shown
    assert _captured(io.StringIO(), lambda: consolidate(tmp_path / "ckpt", tmp_path / "again.safetensors")) == ""
