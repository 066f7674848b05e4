"""Accelerator: one training loop, written once, gives the single-process PyTorch result at every stage.

The sharded runs use 2 real gloo processes, one started job for most of them (``two_ranks``: starting
processes costs more than the cases). The reference is plain PyTorch in one process on the
full batch (batch per rank x world size x accumulation steps), clipping with
``torch.nn.utils.clip_grad_norm_``. Accumulation comes from the config only; the parity cases clip
from the config, in the loop, or not at all (``CLIPPING``).
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.models import RegressionNet, regression_data
from support.sharding_harness import GRAD_RTOL
from torch.utils.data import DataLoader, TensorDataset

from xshard.runtime.data import ShardSampler
from xshard.utils import DataLoaderConfiguration

#: a plain shuffle's order from the seed and the epoch (Accelerate's seedable sampler), the same on every
#: world size: the order of the references here
SEEDABLE = DataLoaderConfiguration(use_seedable_sampler=True)

N, DIM, BATCH, WORLD, ACCUM, CLIP = 32, 8, 2, 2, 2, 0.05

#: the parity cases, by who clips: (the config's ``gradient_clipping``, the ``max_norm`` the loop passes to
#: ``acc.clip_grad_norm_`` under ``acc.sync_gradients``). "config": ``optimizer.step()`` clips and the loop
#: never sees the norm; "loop": the loop clips and gets the norm before clipping; "none": no clipping, the
#: loop reads the norm (``max_norm=inf``). CLIP clips every step, and clipping with AdamW cancels a uniform
#: gradient scale in the weights and losses (AdamW alone nearly does): only the norms show a wrong average.
CLIPPING: dict[str, tuple[float | None, float | None]] = {
    "config": (CLIP, None), "loop": (None, CLIP), "none": (None, float("inf"))}


def _data() -> TensorDataset:
    return regression_data(N, DIM)


def _model() -> RegressionNet:
    torch.manual_seed(0)
    return RegressionNet(DIM, width=16, depth=3)


def _optimizer(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _reference(epochs: int = 1, max_norm: float = CLIP, grad_scale: float = 1.0) -> dict:
    """Plain PyTorch, one process, the full batch of each optimizer step; each step's gradient norm
    before clipping to ``max_norm`` (inf: no clipping). ``grad_scale`` multiplies every gradient before
    clipping: the mutation a wrong average makes (2.0: a SUM over 2 ranks; 0.5: a divide done twice)."""
    model = _model()
    opt, sched = _optimizer(model)
    data = _data()
    sampler = ShardSampler(N, 1, 0, shuffle=True, seed=0)
    step_size = BATCH * WORLD * ACCUM
    losses, norms = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for s in range(N // step_size):
            idx = order[s * step_size:(s + 1) * step_size]
            loss = model(*data[idx])
            loss.backward()
            if grad_scale != 1.0:
                for p in model.parameters():
                    p.grad.mul_(grad_scale)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            opt.step()
            for _ in range(WORLD):  # Accelerate's rule: one schedule step per process per optimizer step
                sched.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {"state": model.state_dict(), "losses": losses, "lr": sched.get_last_lr(), "norms": norms}


def _train(acc, model, opt, loader, sched, epochs, max_norm=None, norms=None):
    """The loop a user writes once (DESIGN.md), no accumulation arguments; with ``max_norm``, it clips
    under ``acc.sync_gradients`` and appends the norms ``clip_grad_norm_`` returns to ``norms``."""
    micro_losses = []
    for _ in range(epochs):
        for batch in loader:
            with acc.accumulate(model), acc.autocast():
                loss = model(*batch)
                acc.backward(loss)
                if max_norm is not None and acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), max_norm).item())
                opt.step()
                sched.step()
                opt.zero_grad()
            micro_losses.append(acc.reduce(loss.detach(), "mean").item())
    return micro_losses


def _prepared(stage, extra=None, clip=CLIP):
    import xshard

    config = {"stage": stage, "gradient_accumulation_steps": ACCUM, **(extra or {})}
    if clip is not None:
        config["gradient_clipping"] = clip
    acc = xshard.Accelerator(config=config, seed=0, dataloader_config=SEEDABLE)
    model = _model()
    opt, sched = _optimizer(model)  # built before prepare: the parameters stay valid
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    return (acc, *acc.prepare(model, opt, loader, sched))


def _parity_worker(rank, world_size, stages, epochs):
    results: dict[str, dict] = {}
    for name, (config_clip, loop_clip) in CLIPPING.items():
        results[name] = {}
        for stage in stages:
            acc, model, opt, loader, sched = _prepared(stage, clip=config_clip)
            norms: list[float] = []
            micro = _train(acc, model, opt, loader, sched, epochs, loop_clip, norms)
            results[name][stage] = {"state": acc.full_state_dict(model), "micro": micro, "norms": norms,
                                    "lr": sched.get_last_lr()}
    return results


def _cases_worker(rank, world_size, folder):
    """The 2-rank cases below, in turn, in the same processes; the first ends three jobs one after another,
    and the cases after it start a new one."""
    return {
        "jobs_after_the_end": _jobs_after_the_end_worker(rank, world_size),  # ends its jobs: the rest start anew
        "parity": _parity_worker(rank, world_size, (0, 1, 2, 3), 2),
        "accumulation": _accumulation_worker(rank, world_size),
        "fp16_skip": _fp16_skip_worker(rank, world_size),
        "checkpoint": _checkpoint_worker(rank, world_size, folder),
        "drawn_order": _drawn_order_worker(rank, world_size, folder.parent / "drawn"),
        "api": _api_worker(rank, world_size),  # ends the job
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list]:
    """Each case's results by rank (``_cases_worker``); the checkpoint case's folder is ``["folder"]``."""
    folder = tmp_path_factory.mktemp("accelerator") / "ckpt"
    per_rank = run_workers(_cases_worker, WORLD, folder)
    return {"folder": folder, **{name: [r[name] for r in per_rank] for name in per_rank[0]}}


def _assert_matches(per_rank: list[dict], ref: dict, label: str) -> None:
    """One case's run on every rank equals the reference: each rank's gradient norm before clipping at
    every optimizer step (within ``GRAD_RTOL``; checked first, as the one comparison a wrong average
    cannot pass), then rank 0's full weights, its window losses and the learning rate."""
    for rank, res in enumerate(per_rank):
        assert len(res["norms"]) == len(ref["norms"]), f"{label} rank {rank}: {len(res['norms'])} gradient norms"
        for step, (mine, theirs) in enumerate(zip(res["norms"], ref["norms"], strict=True)):
            assert abs(mine - theirs) <= GRAD_RTOL * abs(theirs), (
                f"{label} step {step} rank {rank}: gradient norm {mine} vs reference {theirs} "
                f"(ratio {mine / theirs:.4f})")
    res = per_rank[0]
    assert res["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(res["state"][key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"{label}, {k}: {m}")
    # the mean of each window's two micro-batch losses is the reference's full-batch loss
    windows = [sum(res["micro"][i:i + ACCUM]) / ACCUM for i in range(0, len(res["micro"]), ACCUM)]
    assert windows == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), label
    assert res["lr"] == pytest.approx(ref["lr"]), label  # the scheduler stepped WORLD times per optimizer step


def _check_parity(two_ranks) -> None:
    """Every clipping case at every stage against the reference that clips (or not) alike."""
    for name, (config_clip, loop_clip) in CLIPPING.items():
        ref = _reference(2, config_clip or loop_clip)
        if loop_clip is None:  # optimizer.step() clips: the loop reads no norm
            ref["norms"] = []
        for stage in two_ranks["parity"][0][name]:
            _assert_matches([r[name][stage] for r in two_ranks["parity"]], ref, f"clipping {name}, stage {stage}")


@pytest.mark.multiprocess
def test_every_stage_matches_single_process_pytorch_with_accumulation_and_clipping(two_ranks):
    _check_parity(two_ranks)
    assert all(r["state"] == {} for c in two_ranks["parity"][1].values() for r in c.values())  # rank 0 only


@pytest.mark.multiprocess
@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_a_wrong_gradient_scale_fails_the_parity_comparison(two_ranks, scale):
    """The mutation a SUM in place of an AVG (2x on 2 ranks) or a divide done twice (0.5x) makes: the
    reference with its gradients scaled must fail the comparison in every case that reads the norm (the
    weights and losses alone match it: clipping and AdamW cancel a uniform scale)."""
    for name, (_, loop_clip) in CLIPPING.items():
        if loop_clip is None:
            continue
        ref = _reference(2, loop_clip, grad_scale=scale)
        for stage in two_ranks["parity"][0][name]:
            with pytest.raises(AssertionError, match="gradient norm"):
                _assert_matches([r[name][stage] for r in two_ranks["parity"]], ref,
                                f"x{scale} clipping {name}, stage {stage}")


def _accumulation_worker(rank, world_size):
    """The window is driven by the config alone; the end of an epoch always closes it."""
    import xshard

    acc = xshard.Accelerator(config={"stage": 2, "gradient_accumulation_steps": 3}, seed=0)
    model = _model()
    opt, sched = _optimizer(model)
    # 10 samples / (2 ranks x 1 per batch) = 5 batches per rank: windows of 3 and 2.
    loader = DataLoader(TensorDataset(*_data()[:10]), batch_size=1)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    syncs, comm = [], []
    for batch in loader:
        model.reset_stats()
        with acc.accumulate(model):
            acc.backward(model(*batch))
            opt.step()
            opt.zero_grad()
        syncs.append(acc.sync_gradients)
        comm.append(model.stats()["comm"]["bytes"].get("reduce_scatter", 0))
    return syncs, comm


@pytest.mark.multiprocess
def test_accumulation_window_comes_from_the_config_and_closes_at_the_end_of_an_epoch(two_ranks):
    syncs, comm = two_ranks["accumulation"][0]
    assert syncs == [False, False, True, False, True]
    # no gradient communication inside the window; one reduce-scatter at its end
    assert [c > 0 for c in comm] == syncs


def _fp16_skip_worker(rank, world_size):
    import xshard

    acc = xshard.Accelerator(config={"stage": 3, "mixed_precision": "fp16"}, seed=0)
    model = _model()
    opt, sched = _optimizer(model)
    loader = DataLoader(_data(), batch_size=4)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    # a small start scale, so that only the injected overflow skips a step
    acc.scaler.load_state_dict({"scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 2000, "_growth_tracker": 0})
    lrs, changed = [], []
    for i, batch in enumerate(loader):
        if i == 2:
            break
        before = [p.detach().clone() for p in model.parameters()]
        with acc.accumulate(model), acc.autocast():
            loss = model(*batch)
            if i == 1 and rank == 1:
                loss = loss * float("inf")  # one rank overflows: every rank must skip the step
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
        changed.append(any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True)))
    return lrs, changed


@pytest.mark.multiprocess
def test_fp16_overflow_skips_the_step_on_every_rank_and_the_scheduler_waits(two_ranks):
    for lrs, changed in two_ranks["fp16_skip"]:
        assert changed == [True, False]
        # StepLR stepped once per process (2) after the first step, and not after the skipped one
        assert lrs == pytest.approx([2.5e-3, 2.5e-3])


def _checkpoint_worker(rank, world_size, folder):
    acc, model, opt, loader, sched = _prepared(3)
    it = iter(loader)
    for _ in range(4):  # stop mid-epoch, after two accumulation windows
        batch = next(it)
        with acc.accumulate(model):
            acc.backward(model(*batch))
            opt.step()
            sched.step()
            opt.zero_grad()
    acc.save_state(folder)
    rest = _train(acc, model, opt, _remaining(loader, it), sched, 1)
    rest += _train(acc, model, opt, loader, sched, 1)
    expected = acc.full_state_dict(model)

    acc2, model2, opt2, loader2, sched2 = _prepared(3)
    acc2.load_state(folder)
    resumed = _train(acc2, model2, opt2, loader2, sched2, 2)
    files = sorted(p.name for p in folder.iterdir())

    import warnings

    with acc2.accumulate(model2):  # half a window: the partial gradients cannot be saved
        acc2.backward(model2(*next(iter(loader2))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc2.save_state(folder)
    return expected, acc2.full_state_dict(model2), rest, resumed, files, [str(w.message) for w in caught]


class _remaining:
    """The rest of an iteration already under way, as an iterable loop body (for _train)."""

    def __init__(self, loader, it):
        self.loader, self.it = loader, it

    def __iter__(self):
        return self.it


@pytest.mark.multiprocess
def test_save_and_load_state_resume_mid_epoch_exactly(two_ranks):
    folder = two_ranks["folder"]
    expected, resumed, rest, resumed_losses, files, warned = two_ranks["checkpoint"][0]
    assert files == ["data.pt", "model.safetensors", "optimizer.groups.pt", "optimizer.rank0.safetensors",
                     "optimizer.rank1.safetensors", "rng.rank0.pt", "rng.rank1.pt", "scheduler.pt", "xshard_state.json"]
    assert resumed_losses == pytest.approx(rest, rel=1e-6)
    for key, value in expected.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0)
    assert not (folder.parent / "ckpt.tmp").exists() and not (folder.parent / "ckpt.old").exists()
    assert any("inside an accumulation window" in m for m in warned)  # saved again over it, with a warning


def _generator_loader(seed: int, batch: int) -> DataLoader:
    """A shuffled loader with its own seeded ``torch.Generator`` over the sample numbers 0..N-1."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(TensorDataset(torch.arange(N)), batch_size=batch, shuffle=True, generator=generator)


def _drawn_order_worker(rank, world_size, folder):
    import xshard

    acc = xshard.Accelerator(config={"stage": 0}, seed=0)
    loader = acc.prepare(_generator_loader(100 + rank, BATCH))  # seeded apart: rank 0's generator decides
    epochs = [[b[0].tolist() for b in loader] for _ in range(2)]
    it = iter(loader)
    head = [next(it)[0].tolist() for _ in range(3)]
    acc.save_state(folder)
    tail = [b[0].tolist() for b in it]
    acc2 = xshard.Accelerator(config={"stage": 0}, seed=0)
    resumed = acc2.prepare(_generator_loader(7, BATCH))
    acc2.load_state(folder)
    return epochs, head, tail, [b[0].tolist() for b in resumed]


@pytest.mark.multiprocess
def test_a_loader_with_its_own_generator_splits_the_order_one_process_draws_from_rank_0s(two_ranks):
    """``DataLoader(shuffle=True, generator=g)``: batch k of the ranks together is batch k of one process
    drawing from rank 0's generator with the whole batch, epoch after epoch (Accelerate's
    ``training_check``), and a resume mid-epoch draws the rest of that epoch's order again."""
    (epochs0, head0, tail0, resumed0), (epochs1, head1, tail1, resumed1) = two_ranks["drawn_order"]
    single = _generator_loader(100, BATCH * WORLD)
    for mine, theirs in ((epochs0[0], epochs1[0]), (epochs0[1], epochs1[1]), (head0 + tail0, head1 + tail1)):
        expected = [sorted(b[0].tolist()) for b in single]
        assert [sorted(a + b) for a, b in zip(mine, theirs, strict=True)] == expected
    assert (resumed0, resumed1) == (tail0, tail1)


def _api_worker(rank, world_size):
    import xshard

    acc = xshard.Accelerator(config={"stage": 3}, seed=0)
    order = []
    with acc.main_process_first():
        order.append(rank)
    gathered = acc.gather(torch.tensor([float(rank), 10.0 + rank]))
    scalars = acc.gather(torch.tensor(float(rank)))
    nested = acc.gather({"a": torch.tensor([rank])})
    summed = acc.reduce(torch.tensor(float(rank + 1)), "sum")
    mean = acc.reduce(torch.tensor(float(rank + 1)), "mean")
    model = acc.prepare(_model())
    inner = acc.unwrap_model(model)
    acc.state.wait_for_everyone()  # Accelerate's barrier on the state view: every rank passes it
    state = acc.state
    # the same facts under Accelerate's names, on the Accelerator and on its state
    accelerate_names = [(acc.process_index, acc.num_processes, acc.local_process_index, acc.is_last_process,
                         acc.use_distributed, str(acc.device)),
                        (state.process_index, state.num_processes, state.local_process_index, state.is_last_process,
                         state.use_distributed, str(state.device)),
                        (state.is_main_process, state.is_local_main_process)]
    acc.end()
    return {
        "gathered": gathered, "scalars": scalars, "nested": nested["a"], "sum": summed.item(),
        "mean": mean.item(), "main": acc.is_main_process, "local_main": acc.is_local_main_process,
        "rank": acc.rank, "world": acc.world_size, "inner_is_net": type(inner) is RegressionNet,
        "accelerate_names": accelerate_names,
    }


@pytest.mark.multiprocess
def test_collectives_and_process_facts(two_ranks):
    r0, r1 = two_ranks["api"]
    assert r0["gathered"].tolist() == r1["gathered"].tolist() == [0.0, 10.0, 1.0, 11.0]
    assert r0["scalars"].tolist() == [0.0, 1.0] and r1["nested"].tolist() == [0, 1]
    assert r0["sum"] == r1["sum"] == 3.0 and r0["mean"] == r1["mean"] == 1.5
    assert (r0["main"], r1["main"], r0["local_main"], r1["local_main"]) == (True, False, True, False)
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert r0["inner_is_net"]
    for r, last in ((r0, False), (r1, True)):  # Accelerate's names agree with the facts above on each rank
        on_accelerator, on_state, state_flags = r["accelerate_names"]
        assert on_accelerator == on_state == (r["rank"], 2, r["rank"], last, True, "cpu")
        assert state_flags == (r["main"], r["local_main"])


def _jobs_after_the_end_worker(rank, world_size):
    """Jobs started one after another in the same processes, each ended before the next begins, the last
    job's objects still alive (a loop that rebinds ``acc``), rank 0 late to each new job."""
    import time

    import xshard

    sums = []
    for job in range(3):
        if rank == 0 and job:  # rank 1 asks for rank 0's address before rank 0 published its new one
            time.sleep(1.0)
        acc = xshard.Accelerator(config={"stage": 3}, seed=0)
        model = acc.prepare(_model())
        sums.append(acc.reduce(torch.tensor(float(rank + job)), "sum").item())
        acc.end()
    return sums, model is not None


@pytest.mark.multiprocess
def test_a_new_job_forms_in_processes_whose_last_job_ended(two_ranks):
    """A script that ends its job (``end()``) and builds another Accelerator gets a working process group
    (the new group rendezvouses under its own keys, never the ended group's addresses)."""
    assert two_ranks["jobs_after_the_end"] == [([1.0, 3.0, 5.0], True)] * 2


def _unseeded_worker(rank, world_size):
    import xshard

    acc = xshard.Accelerator(config={"stage": 0})  # no seed anywhere: ranks build different models
    torch.manual_seed(100 + rank)
    model = acc.prepare(RegressionNet(DIM, width=16, depth=3))
    return {k: v.clone() for k, v in model.module.state_dict().items()}


@pytest.mark.multiprocess
def test_an_unseeded_job_starts_every_rank_from_rank_0_weights(clean_env):  # its own job: no XSHARD_* variables
    r0, r1 = run_workers(_unseeded_worker, WORLD)
    for key in r0:
        assert torch.equal(r0[key], r1[key]), key


def test_single_process_bf16_autocast_trains(clean_env):
    import xshard

    acc = xshard.Accelerator(config={"stage": 0, "mixed_precision": "bf16"}, seed=0)
    model = _model()
    opt, sched = _optimizer(model)
    model, opt, loader, sched = acc.prepare(model, opt, DataLoader(_data(), batch_size=8), sched)
    seen = []
    for batch in loader:
        with acc.accumulate(model), acc.autocast():
            h = model.inp(batch[0])
            seen.append(h.dtype)
            acc.backward(model(*batch))
            opt.step()
            opt.zero_grad()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    acc.end()


def test_prepare_rejects_what_it_cannot_prepare(clean_env):
    import xshard

    acc = xshard.Accelerator(seed=0)
    with pytest.raises(TypeError, match="prepare\\(\\) got a dict"):
        acc.prepare({"not": "a model"})
    acc.end()


def test_accelerator_is_exported_lazily():
    import xshard

    assert xshard.Accelerator.__name__ == "Accelerator"
    assert xshard.XShardConfig.__name__ == "XShardConfig"
