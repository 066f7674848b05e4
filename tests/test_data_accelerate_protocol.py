"""The prepared loader as Accelerate's own example programs use it: the shuffle a script's ``set_seed`` decides, in
both of Accelerate's modes, and a torch ``DataLoader``'s iterator protocol.

In one process, against Accelerate's ``prepare_data_loader`` on the same loader after the same seeding:

- ``shuffle=True`` in Accelerate's default mode draws its order from torch's global RNG: on several processes
  one draw when the loader is prepared seeds the generator every epoch draws from; on one process each pass
  draws anew; the seedable mode (``use_seedable_sampler=True``) takes ``torch.random.initial_seed()`` at prepare
  plus the epoch. The global RNG is left where Accelerate leaves it (the next random numbers are equal);
- each ``iter()`` is a new pass: ``next()`` past the last batch raises ``StopIteration``, a ``break`` ends the
  pass (the next ``for`` starts a new one, counted as Accelerate counts epochs), ``iteration`` / ``set_epoch``,
  ``end_of_dataloader`` on the last batch;
- a resumed pass (``load_state_dict``, ``skip_first_batches``) draws its epoch's order again, also when the
  checkpoint was written after the epoch ended.

On 2 processes (tests/support/accelerate_patterns_script.py, the loops of Accelerate's ``nlp_example.py``,
``gradient_accumulation_for_autoregressive_models.py``, ``early_stopping.py``, ``gradient_accumulation.py``, with
dropout, ``set_seed(42)`` after or before the Accelerator), stock Accelerate under torchrun and xshard under
``xshard launch`` at stages 0 and 3: every step's losses, the samples each process read, the evaluation's
predictions and the final weights are equal; a run saved mid-epoch or after the first epoch resumes to the
uninterrupted run's steps. The patterns share their jobs: Accelerate's run and xshard's at each stage train every
pattern one after the other in one launch (the script gives each its own Accelerator, seed and model).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
import torch
from support.jobs import run_writing
from support.side_by_side import side_by_side
from torch.utils.data import DataLoader, TensorDataset

from xshard.runtime.data import shard_data_loader

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support" / "accelerate_patterns_script.py"


def _loader(n: int = 22, batch: int = 3) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, shuffle=True)


def _ids(batch) -> list[int]:
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()


def _theirs(world: int, rank: int, seedable: bool = False):
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(_loader(), num_processes=world, process_index=rank, put_on_device=False,
                               dispatch_batches=False, even_batches=True, use_seedable_sampler=seedable)


def _ours(world: int, rank: int, seedable: bool = False):
    return shard_data_loader(_loader(), CPU, world, rank, seed=torch.random.initial_seed() if seedable else None)


def _epochs(loader, epochs: int = 3) -> list[list[list[int]]]:
    return [[_ids(b) for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("seedable", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_plain_shuffle_after_set_seed_is_accelerates_order_and_leaves_the_rng_where_accelerate_does(world, seedable):
    def run(build) -> tuple[list, float]:
        per_rank = []
        for rank in range(world):
            torch.manual_seed(42)  # every process seeds alike (the script's set_seed)
            torch.rand(5)  # the model's initialisation, say
            loader = build(world, rank, seedable)
            per_rank.append(_epochs(loader))
        return per_rank, torch.rand(1).item()  # the next random number (a dropout mask) after the last pass

    ours, ours_next = run(_ours)
    theirs, theirs_next = run(_theirs)
    assert ours == theirs
    assert ours_next == theirs_next
    assert ours[0][0] != ours[0][1]  # a new order each epoch


def test_each_iter_is_a_new_pass_as_accelerates():
    """``next()`` exactly ``len(loader)`` times per epoch with a new ``iter()`` each epoch, a ``break`` and a
    new ``for``, ``next()`` past the end: the batches, epochs and errors of Accelerate's loader."""
    def walk(loader) -> list:
        seen: list = []
        for _ in range(2):  # the autoregressive example: next() len(loader) times, then a new iter()
            iterator = iter(loader)
            seen.append([_ids(next(iterator)) for _ in range(len(loader))])
            seen.append(("end", loader.end_of_dataloader, loader.iteration))
        iterator = iter(loader)
        for _ in range(len(loader)):
            next(iterator)
        with pytest.raises(StopIteration):
            next(iterator)
        seen.append(("after StopIteration", loader.iteration))
        for i, batch in enumerate(loader):  # early stopping: a break ...
            seen.append(_ids(batch))
            if i == 2:
                break
        seen.append(("broken", loader.iteration))
        seen.append([_ids(b) for b in loader])  # ... and the next for loop is a new pass
        seen.append(("done", loader.iteration))
        loader.set_epoch(7)
        seen.append([_ids(b) for b in loader])
        seen.append(("set_epoch", loader.iteration))
        return seen

    for seedable in (False, True):
        torch.manual_seed(3)
        ours = walk(_ours(1, 0, seedable))
        torch.manual_seed(3)
        theirs = walk(_theirs(1, 0, seedable))
        assert ours == theirs, seedable


def _resumed(seedable: bool, save_after: int, world: int = 2) -> tuple[list, list]:
    """Rank 0's batches of 3 epochs uninterrupted, and of a loader saved after ``save_after`` batches (counted
    over the run) and resumed in a new loader."""
    torch.manual_seed(42)
    whole = _epochs(_ours(world, 0, seedable))
    torch.manual_seed(42)
    loader = _ours(world, 0, seedable)
    read: list = []
    state = None
    while state is None:
        for batch in loader:
            read.append(_ids(batch))
            if len(read) == save_after:
                state = loader.state_dict()
                break
    torch.manual_seed(42)
    again = _ours(world, 0, seedable)  # a new process: the same script up to the resume
    again.load_state_dict(state)
    while again.epoch < 3:
        read += [_ids(b) for b in again]
    return [b for epoch in whole for b in epoch], read


@pytest.mark.parametrize("seedable", [False, True])
@pytest.mark.parametrize("save_after", [2, 4, 8])  # mid-epoch, on the epoch's last batch, mid second epoch
def test_a_resumed_loader_reads_the_uninterrupted_order(seedable, save_after):
    whole, read = _resumed(seedable, save_after)
    assert read == whole


def test_a_loader_saved_after_its_epoch_ended_resumes_with_the_next_epochs_order():
    """The checkpointing example's save: after the epoch's ``for`` loop, before the next one."""
    for seedable in (False, True):
        torch.manual_seed(42)
        loader = _ours(2, 0, seedable)
        first = [_ids(b) for b in loader]
        state = loader.state_dict()
        second = [_ids(b) for b in loader]
        torch.manual_seed(42)
        again = _ours(2, 0, seedable)
        again.load_state_dict(state)
        assert [_ids(b) for b in again] == second != first, seedable


def test_skip_first_batches_starts_one_pass_there_and_the_next_pass_is_whole():
    torch.manual_seed(5)
    loader = _ours(1, 0, True)
    whole = [_ids(b) for b in loader]
    loader.set_epoch(0)
    from xshard.runtime.data import skip_first_batches

    assert [_ids(b) for b in skip_first_batches(loader, 3)] == whole[3:]
    assert len([_ids(b) for b in loader]) == len(whole)  # epoch 1, from its start


# ---------------------------------------------------------------------------- 2 processes, the examples' loops
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
XSHARD = [sys.executable, "-m", "xshard", "launch", "--nproc", "2"]


def _run(accelerator: str, cwd: Path, patterns: str, stage: int | None = None, *args: str) -> dict[str, dict]:
    """One job training ``patterns`` (comma-separated) one after the other; each pattern's results by pattern."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XSHARD_", "ACCELERATE_"))}
    env.update(ACCELERATOR=accelerator, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    anchor = accelerator == "accelerate"
    result = cwd / f"anchor-result-{uuid.uuid4().hex}.json"
    if anchor:  # the anchor: read from the file it writes, its exit is not under test
        env.update(ACCELERATE_USE_CPU="true", RESULT_FILE=str(result))
    else:
        env["XSHARD_STAGE"] = str(stage)
    launcher = TORCHRUN if anchor else XSHARD
    out, _ = run_writing([*launcher, str(SCRIPT), "--pattern", patterns, *args], [result] if anchor else [],
                         anchor=anchor, timeout=240, cwd=cwd, env=env)
    if anchor:
        return json.loads(result.read_text())
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-2000:]
    return json.loads(lines[0][len("RESULT "):])


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def _same(ours: dict, reference: dict) -> None:
    assert ours["read"] == reference["read"]
    assert ours["flags"] == reference["flags"]
    assert len(ours["losses"]) == len(reference["losses"])
    assert _flat(ours["losses"]) == pytest.approx(_flat(reference["losses"]), rel=1e-5, abs=1e-7)
    assert [ids for _, ids in ours["predictions"]] == [ids for _, ids in reference["predictions"]]
    assert _flat([p for p, _ in ours["predictions"]]) == pytest.approx(
        _flat([p for p, _ in reference["predictions"]]), rel=1e-5, abs=1e-7)
    for name, values in reference["weights"].items():
        assert ours["weights"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


#: the loops, and the stages xshard runs each at (0 and 3 where the stage changes what the loop meets)
PATTERNS = {"default": (0, 3), "seedable": (3,), "seed_first": (3,), "next_calls": (0, 3), "early_stop": (3,),
            "accumulate": (3,)}


@pytest.fixture(scope="module")
def example_loops(tmp_path_factory) -> tuple[dict[str, dict], dict[int, dict[str, dict]]]:
    """Accelerate's run of every pattern, and xshard's at each stage (one job each, side by side)."""
    tmp = tmp_path_factory.mktemp("example_loops")
    stages = sorted({s for wanted in PATTERNS.values() for s in wanted})
    at = {s: ",".join(p for p, wanted in PATTERNS.items() if s in wanted) for s in stages}
    reference, *ours = side_by_side(lambda: _run("accelerate", tmp, ",".join(PATTERNS)),
                                    *[lambda s=s: _run("xshard", tmp, at[s], s) for s in stages])
    return reference, dict(zip(stages, ours, strict=True))


@pytest.mark.multiprocess
@pytest.mark.timeout(420)  # the module's jobs: about 60 s idle
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_accelerates_example_loops_give_accelerates_numbers(example_loops, pattern):
    reference, ours = example_loops[0][pattern], example_loops[1]
    assert len(reference["losses"]) == (5 + 6 + 6 if pattern == "early_stop" else 18)  # 3 epochs of 6 steps
    for stage in PATTERNS[pattern]:
        try:
            _same(ours[stage][pattern], reference)
        except AssertionError as error:
            raise AssertionError(f"stage {stage}: {error}") from error


@pytest.mark.multiprocess
@pytest.mark.parametrize("pattern", ["default", "seedable"])
def test_an_example_loop_saved_mid_epoch_or_after_it_resumes_to_the_uninterrupted_run(tmp_path, pattern):
    whole = _run("xshard", tmp_path, pattern, 3, "--save_at", "3", "--output_dir", "xs")[pattern]
    mid, after = (run[pattern] for run in side_by_side(
        lambda: _run("xshard", tmp_path, pattern, 3, "--resume", str(tmp_path / "xs" / pattern / "mid")),
        lambda: _run("xshard", tmp_path, pattern, 3, "--resume", str(tmp_path / "xs" / pattern / "epoch"))))
    assert mid["read"] == whole["read"][3:]
    assert _flat(mid["losses"]) == pytest.approx(_flat(whole["losses"][3:]), rel=1e-5, abs=1e-7)
    assert after["read"] == whole["read"][6:]
    assert _flat(after["losses"]) == pytest.approx(_flat(whole["losses"][6:]), rel=1e-5, abs=1e-7)
    for name, values in whole["weights"].items():
        assert mid["weights"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name
        assert after["weights"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


@pytest.mark.multiprocess
def test_an_accelerate_checkpoint_of_a_stateful_loader_resumes_where_accelerate_resumes(tmp_path):
    """``use_stateful_dataloader=True``: Accelerate's ``dl_state_dict.bin`` holds the batches the pass had yielded;
    xshard resumed from Accelerate's folder trains the steps Accelerate's own resumed run trains."""
    _run("accelerate", tmp_path, "default", None, "--stateful", "--save_at", "3", "--output_dir", "acc")
    folder = str(tmp_path / "acc" / "default" / "mid")
    theirs, ours = (run["default"] for run in side_by_side(
        lambda: _run("accelerate", tmp_path, "default", None, "--stateful", "--resume", folder),
        lambda: _run("xshard", tmp_path, "default", 0, "--stateful", "--resume", folder)))
    assert len(theirs["losses"]) == 18 - 3
    _same(ours, theirs)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n,batch,drop_last", [(22, 3, False), (24, 4, False), (22, 3, True)])
def test_remainder_is_accelerates_samples_in_the_last_global_batch(world, n, batch, drop_last):
    from accelerate.data_loader import prepare_data_loader

    def seen(loader) -> list[int]:
        out = [loader.remainder]  # before any pass
        for _ in loader:
            out.append(loader.remainder)
        return out

    def build() -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, drop_last=drop_last)

    ours = seen(shard_data_loader(build(), CPU, world, 0))
    theirs = seen(prepare_data_loader(build(), num_processes=world, process_index=0, put_on_device=False,
                                      dispatch_batches=False, even_batches=True))
    assert ours == theirs
