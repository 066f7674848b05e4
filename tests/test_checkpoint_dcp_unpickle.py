"""A torch.distributed.checkpoint folder's ``.metadata`` is read without running code: a crafted folder
whose pickle would create a file is refused, naming the type it asked for, and creates nothing."""

from __future__ import annotations

import os
import pickle

import pytest
from test_checkpoint import _job

from xshard.checkpoint.files import CheckpointError


class _Payload:
    def __init__(self, evidence: str) -> None:
        self.evidence = evidence

    def __reduce__(self):
        return (os.mkdir, (self.evidence,))  # what a crafted pickle runs when unpickled


def test_a_crafted_dcp_metadata_runs_no_code(tmp_path):
    acc, *_ = _job(1)
    folder, evidence = tmp_path / "accelerate_ckpt", tmp_path / "the_pickle_ran"
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):  # Accelerate's SHARDED_STATE_DICT folders
        (folder / sub).mkdir(parents=True)
        (folder / sub / ".metadata").write_bytes(pickle.dumps(_Payload(str(evidence)), protocol=4))
    with pytest.raises(CheckpointError, match=r"not a readable torch.distributed.checkpoint folder.*posix\.mkdir"):
        acc.load_state(folder)
    assert not evidence.exists()
