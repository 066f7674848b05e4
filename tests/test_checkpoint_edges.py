"""Nothing lost at the edges of checkpoints, on real checkpoints of a 2-process job:

- ``xshard consolidate`` never replaces an existing output without ``--overwrite`` (and then writes beside it
  and renames it in), removes the partial file a killed consolidate left (this user's, its process gone; a live
  process's is left alone), and refuses a folder a save has not committed, naming the last complete checkpoint;
- a manifest that is a link to a file outside the checkpoint folder is refused by ``load_state`` and
  ``consolidate``;
- a save whose checkpoint name is a link leading outside the output folder is refused, and nothing is written
  through it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess


def _save_worker(rank, world_size, root, names):
    import xshard

    acc = xshard.Accelerator(config={"stage": 3}, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    outcome = {}
    for name in names:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        try:
            acc.save_state(os.path.join(root, name))
            outcome[name] = "saved"
        except Exception as exc:  # the refusal a user sees
            outcome[name] = f"{type(exc).__name__}: {exc}"
    acc.end()
    return outcome


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    assert run_workers(_save_worker, 2, str(root), ["checkpoint-1", "checkpoint-2"])[0] == {
        "checkpoint-1": "saved", "checkpoint-2": "saved"}
    return root


def _consolidate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xshard", "consolidate", *args], capture_output=True, text=True,
                          timeout=120)


def test_consolidate_refuses_an_existing_output_and_replaces_it_only_when_asked(checkpoints, tmp_path):
    mine = tmp_path / "weights.safetensors"
    mine.write_bytes(b"a file of the user's")
    refused = _consolidate(str(checkpoints / "checkpoint-2"), str(mine))
    assert refused.returncode == 2
    assert "exists: consolidate does not replace it; pass --overwrite" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert mine.read_bytes() == b"a file of the user's"

    replaced = _consolidate(str(checkpoints / "checkpoint-2"), str(mine), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    from safetensors.torch import load_file

    assert set(load_file(mine)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]  # nothing left beside it


def test_consolidate_removes_a_killed_runs_partial_file_but_not_a_live_ones(checkpoints, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".model.safetensors.{dead.pid}.tmp"
    stale.write_bytes(b"half" * 1000)
    live = tmp_path / f".model.safetensors.{os.getpid()}.tmp"  # a run writing it now (this process is alive)
    live.write_bytes(b"being written")
    done = _consolidate(str(checkpoints / "checkpoint-1"), str(tmp_path / "model.safetensors"))
    assert done.returncode == 0, done.stderr
    assert not stale.exists()
    assert live.read_bytes() == b"being written"


def test_consolidate_refuses_a_folder_a_save_did_not_commit_naming_the_last_complete_one(checkpoints, tmp_path):
    unfinished = checkpoints / "checkpoint-3.tmp"
    shutil.copytree(checkpoints / "checkpoint-2", unfinished)
    try:
        refused = _consolidate(str(unfinished), str(tmp_path / "out.safetensors"))
    finally:
        shutil.rmtree(unfinished)
    assert refused.returncode == 2
    assert "is not a committed checkpoint" in refused.stderr
    assert f"the last complete checkpoint there is {checkpoints / 'checkpoint-2'}" in refused.stderr
    assert not (tmp_path / "out.safetensors").exists()


def _load_worker(rank, world_size, folder):
    import xshard

    acc = xshard.Accelerator(config={"stage": 3}, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    try:
        acc.load_state(folder)
        return "loaded"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        acc.end()


def test_a_manifest_that_links_outside_its_folder_is_refused(checkpoints, tmp_path):
    forged = tmp_path / "forged"
    shutil.copytree(checkpoints / "checkpoint-2", forged)
    outside = tmp_path / "elsewhere.json"
    shutil.move(forged / "xshard_state.json", outside)
    (forged / "xshard_state.json").symlink_to(outside)
    outcome = run_workers(_load_worker, 2, str(forged))
    assert all("leads outside the checkpoint folder" in o for o in outcome), outcome
    refused = _consolidate(str(forged), str(tmp_path / "w.safetensors"))
    assert refused.returncode == 2 and "leads outside the checkpoint folder" in refused.stderr


def test_a_checkpoint_name_that_links_outside_the_output_folder_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    outcome = run_workers(_save_worker, 2, str(out), ["checkpoint-1", "checkpoint-2"])[0]
    assert outcome["checkpoint-1"] == "saved"
    assert "is a link to" in outcome["checkpoint-2"] and "outside the output folder" in outcome["checkpoint-2"]
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
