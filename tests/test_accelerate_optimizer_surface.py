"""The prepared optimizer and scheduler, and ``gradient_accumulation_steps = n``, against stock Accelerate.

One snippet per behaviour runs on 2 real processes under stock Accelerate (``Accelerator(cpu=True)``, its
multi-CPU data parallel) and under xshard (stages 0 and 3), and the results are compared:

- a schedule-free optimizer (``TinyScheduleFree``: ``train()`` / ``eval()`` swap the parameters between
  the training point and the average, as schedulefree's optimizers do) called through the prepared
  optimizer, as Accelerate's ``schedule_free.py`` example does: the same training and evaluation losses;
- ``accelerator.gradient_accumulation_steps = 3`` in the middle of a window (Accelerate's
  ``automatic_gradient_accumulation.py`` sets it): the same ``sync_gradients`` flags, ``gradient_state``
  and losses, into the next epoch;
- the optimizer's members: ``param_groups`` / ``state`` / ``defaults`` / ``state_dict`` /
  ``load_state_dict`` / ``add_param_group``, ``zero_grad(set_to_none=False)``, ``step_was_skipped``,
  ``train()`` / ``eval()`` on an optimizer without them, pickling; the hook registrations, which raise
  ``AttributeError`` on Accelerate 1.15 and work here (the step hooks run at each real step only);
- the scheduler's members: ``get_last_lr`` / ``get_lr`` / ``state_dict`` / ``load_state_dict`` and
  ``print_lr`` (torch's schedulers no longer have it: an ``AttributeError`` on both).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from support.distributed import run_workers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent


class TinyScheduleFree(torch.optim.Optimizer):
    """Schedule-free SGD in a few lines: ``z`` takes the gradient steps, ``x`` is their running average, the
    parameters hold ``y = (1 - beta) z + beta x`` while training and ``x`` after ``eval()``."""

    def __init__(self, params, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        self.training = False

    def _states(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(z=p.detach().clone(), x=p.detach().clone(), k=0)
                yield group, p, state

    @torch.no_grad()
    def train(self) -> None:
        for group, p, state in self._states():
            if not self.training:
                p.copy_((1 - group["beta"]) * state["z"] + group["beta"] * state["x"])
        self.training = True

    @torch.no_grad()
    def eval(self) -> None:
        for _group, p, state in self._states():
            if self.training:
                p.copy_(state["x"])
        self.training = False

    @torch.no_grad()
    def step(self, closure=None):
        assert self.training, "a schedule-free optimizer steps in train mode"
        for group, p, state in self._states():
            if p.grad is None:
                continue
            state["z"].sub_(group["lr"] * p.grad)
            state["k"] += 1
            state["x"].lerp_(state["z"], 1 / state["k"])
            p.copy_((1 - group["beta"]) * state["z"] + group["beta"] * state["x"])


class Net(nn.Module):
    _no_split_modules = ["Linear"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(torch.tanh(self.body(x))).squeeze(-1), y)


def _loader(n: int = 20, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(-1)), batch_size=batch_size)


def _accelerator(library: str, stage: int, **kwargs):
    if library == "accelerate":
        from accelerate import Accelerator

        return Accelerator(cpu=True, **kwargs)
    import xshard

    return xshard.Accelerator(stage=stage, seed=0, **kwargs)


def _schedule_free(library: str, stage: int) -> dict:
    acc = _accelerator(library, stage)
    net = Net()
    model, opt, loader, eval_loader = acc.prepare(net, TinyScheduleFree(net.parameters()), _loader(), _loader(8))
    train_losses, eval_losses = [], []
    for _epoch in range(2):
        model.train()
        opt.train()
        for x, y in loader:
            loss = model(x, y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            train_losses.append(round(loss.item(), 6))
        model.eval()
        opt.eval()  # the parameters hold the average now
        with torch.no_grad():
            eval_losses += [round(model(x, y).item(), 6) for x, y in eval_loader]
    return {"train": train_losses, "eval": eval_losses}


def _setter(library: str, stage: int) -> dict:
    acc = _accelerator(library, stage, gradient_accumulation_steps=2)
    net = Net()
    model, opt, loader = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), _loader(32))
    seen, micro = [], 0
    for _epoch in range(2):  # 8 micro-steps per rank per epoch
        for x, y in loader:
            micro += 1
            if micro == 5:  # after two windows of 2: from here on, 3 per optimizer step
                acc.gradient_accumulation_steps = 3
            with acc.accumulate(model):
                loss = model(x, y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            seen.append((acc.sync_gradients, acc.gradient_accumulation_steps, acc.gradient_state.num_steps,
                         acc.gradient_state.plugin_kwargs["num_steps"], round(loss.item(), 6)))
    return {"micro_steps": seen}


def _optimizer_members(library: str, stage: int) -> dict:
    acc = _accelerator(library, stage, gradient_accumulation_steps=2)
    net = Net()
    users = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, opt, loader = acc.prepare(net, users, _loader(8))
    out: dict = {"wrapped": (opt.optimizer is users, opt.scaler, opt.device_placement)}
    out["state_members"] = {}
    for name in ("accelerator_state", "gradient_state"):  # Accelerate's singletons; xshard names the Accelerator's
        try:
            out["state_members"][name] = type(getattr(opt, name)).__name__
        except AttributeError as exc:
            out["state_members"][name] = str(exc)
    opt.param_groups[0]["lr"] = 0.05  # a schedule written by hand reaches the user's optimizer
    out["lr_reaches_optimizer"] = opt.optimizer.param_groups[0]["lr"] == 0.05
    out["defaults"] = (opt.defaults["lr"], opt.defaults["momentum"])
    out["train_eval_without_them"] = (opt.train(), opt.eval())
    hooks: dict[str, int] = {}
    for name in ("register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
                 "register_state_dict_post_hook", "register_load_state_dict_pre_hook",
                 "register_load_state_dict_post_hook"):
        try:
            getattr(opt, name)(lambda *args, name=name: hooks.__setitem__(name, hooks.get(name, 0) + 1))
            hooks.setdefault(name, 0)
        except AttributeError as exc:
            hooks[name] = f"AttributeError: {exc}"
    for x, y in loader:  # 2 micro-steps per rank: 1 optimizer step
        with acc.accumulate(model):
            acc.backward(model(x, y))
            opt.step()
            opt.zero_grad(set_to_none=False)
            out.setdefault("grads_after_zero_grad", []).append(
                [None if p.grad is None else float(p.grad.abs().sum()) for p in opt.optimizer.param_groups[0]["params"]])
    state = opt.state_dict()
    out["momentum_buffers"] = sum("momentum_buffer" in s for s in state["state"].values()) > 0
    opt.load_state_dict(state)
    out["state_is_the_optimizers"] = opt.state is opt.optimizer.state
    out["step_was_skipped"] = opt.step_was_skipped
    out["hooks"] = hooks
    copy = pickle.loads(pickle.dumps(opt))
    out["pickled"] = (type(copy).__name__ == type(opt).__name__, copy.optimizer.param_groups[0]["lr"],
                      len(copy.state_dict()["state"]) == len(state["state"]))
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    out["groups"] = (len(opt.param_groups), len(opt.optimizer.param_groups), opt.param_groups[-1]["lr"])
    return out


def _scheduler_members(library: str, stage: int) -> dict:
    acc = _accelerator(library, stage)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, loader, sched = acc.prepare(net, opt, _loader(8), torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    for x, y in loader:
        acc.backward(model(x, y))
        opt.step()
        sched.step()
        opt.zero_grad()
    out = {"last_lr": sched.get_last_lr(), "state": sched.state_dict()["last_epoch"],
           "wrapped": (sched.scheduler.optimizer is opt.optimizer, [o is opt for o in sched.optimizers],
                       sched.split_batches, sched.step_with_optimizer)}
    try:
        out["gradient_state"] = type(sched.gradient_state).__name__
    except AttributeError as exc:
        out["gradient_state"] = str(exc)
    with warnings.catch_warnings():  # torch's "To get the last learning rate computed by the scheduler ..."
        warnings.simplefilter("ignore")
        out["lr"] = sched.get_lr()
    sched.load_state_dict({**sched.state_dict(), "last_epoch": 1})
    out["loaded"] = sched.scheduler.last_epoch
    try:
        sched.print_lr(True, 0, 0.1)
        out["print_lr"] = "ran"
    except AttributeError as exc:
        out["print_lr"] = f"AttributeError: {exc}"
    return out


SNIPPETS = {"schedule_free": _schedule_free, "setter": _setter, "optimizer": _optimizer_members,
            "scheduler": _scheduler_members}


def _worker(rank, world_size, library, stage):
    return {name: snippet(library, stage) for name, snippet in SNIPPETS.items()}


@pytest.fixture(scope="module")
def runs():
    """Every snippet's results on 2 processes: stock Accelerate, and xshard at stages 0 and 3."""
    return {"accelerate": run_workers(_worker, 2, "accelerate", 0), "xshard0": run_workers(_worker, 2, "xshard", 0),
            "xshard3": run_workers(_worker, 2, "xshard", 3)}


@pytest.mark.parametrize("ours", ["xshard0", "xshard3"])
def test_a_schedule_free_optimizers_train_and_eval_give_accelerates_losses(runs, ours):
    for rank in (0, 1):
        reference, got = runs["accelerate"][rank]["schedule_free"], runs[ours][rank]["schedule_free"]
        assert len(got["train"]) == 10 and len(got["eval"]) == 4
        assert got["train"] == pytest.approx(reference["train"], abs=1e-5)
        assert got["eval"] == pytest.approx(reference["eval"], abs=1e-5)
        assert got["eval"][:2] != got["train"][-2:]  # eval() moved the parameters


@pytest.mark.parametrize("ours", ["xshard0", "xshard3"])
def test_setting_gradient_accumulation_steps_mid_run_gives_accelerates_windows_and_losses(runs, ours):
    for rank in (0, 1):
        reference, got = runs["accelerate"][rank]["setter"], runs[ours][rank]["setter"]
        flags = [step[:4] for step in got["micro_steps"]]
        assert flags == [step[:4] for step in reference["micro_steps"]]
        # Accelerate's count runs on from the epoch's start: the window of 3 ends at micro-step 6 (6 % 3 == 0), not
        # 3 after the last window's end; the loader's end closes a window and restarts the count
        assert [f[0] for f in flags] == [False, True, False, True, False, True, False, True,
                                         False, False, True, False, False, True, False, True]
        assert flags[-1][1:] == (3, 3, 3)
        losses = [step[4] for step in got["micro_steps"]]
        assert losses == pytest.approx([step[4] for step in reference["micro_steps"]], abs=1e-5)


def test_the_prepared_optimizers_members_reach_the_users_optimizer_as_in_accelerate(runs):
    for ours in ("xshard0", "xshard3"):
        for rank in (0, 1):
            reference, got = dict(runs["accelerate"][rank]["optimizer"]), dict(runs[ours][rank]["optimizer"])
            accelerate_hooks, hooks = reference.pop("hooks"), got.pop("hooks")
            assert reference.pop("state_members") == {"accelerator_state": "AcceleratorState",
                                                      "gradient_state": "GradientState"}
            assert got.pop("state_members") == {
                name: f"PreparedOptimizer.{name} is Accelerate's; the prepared objects do not hold the Accelerator's "
                      f"state: read {where}"
                for name, where in (("accelerator_state", "accelerator.state"),
                                    ("gradient_state", "accelerator.gradient_state"))}
            if ours == "xshard3":  # this rank's shards: other gradient sums, the same gating
                reference.pop("grads_after_zero_grad"), got.pop("grads_after_zero_grad")
            assert got == reference, ours
            # Accelerate 1.15 inherits torch's registrations without torch's __init__: they raise there
            assert all(str(v).startswith("AttributeError") for v in accelerate_hooks.values())
            # xshard: on the user's optimizer; one real step in 2 micro-steps, one state_dict, one load
            assert hooks == dict.fromkeys(accelerate_hooks, 1), (ours, hooks)
    grads = runs["xshard0"][0]["optimizer"]["grads_after_zero_grad"]
    assert all(g is not None and g > 0 for g in grads[0]) and all(g == 0 for g in grads[1])  # set_to_none=False


def test_the_prepared_schedulers_members_answer_as_accelerates(runs):
    for ours in ("xshard0", "xshard3"):
        for rank in (0, 1):
            reference = dict(runs["accelerate"][rank]["scheduler"])
            got = dict(runs[ours][rank]["scheduler"])
            assert reference.pop("gradient_state") == "GradientState"
            assert got.pop("gradient_state") == ("PreparedScheduler.gradient_state is Accelerate's; the prepared "
                                                 "objects do not hold the Accelerator's state: read "
                                                 "accelerator.gradient_state")
            assert got == reference, ours
    assert runs["xshard0"][0]["scheduler"]["print_lr"].startswith("AttributeError")


def test_a_prepared_optimizer_unpickled_in_another_process_says_what_to_pickle(tmp_path):
    import xshard

    acc = xshard.Accelerator(backend="cpu", stage=0)
    net = Net()
    opt = acc.prepare(torch.optim.SGD(net.parameters(), lr=0.1))
    (tmp_path / "opt.pkl").write_bytes(pickle.dumps(opt))
    code = f"import pickle; pickle.loads(open({str(tmp_path / 'opt.pkl')!r}, 'rb').read())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    acc.end()
    assert done.returncode != 0
    assert "a prepared optimizer unpickles only in the process of its Accelerator" in done.stderr
    assert "pickle optimizer.optimizer or optimizer.state_dict() instead" in done.stderr


def test_gradient_accumulation_steps_refuses_what_is_not_a_positive_int():
    import xshard

    acc = xshard.Accelerator(backend="cpu", stage=0)
    try:
        for bad in (0, -1, 2.0, "2"):
            with pytest.raises(ValueError, match=f"gradient_accumulation_steps must be a positive int, got {bad!r}"):
                acc.gradient_accumulation_steps = bad
        assert acc.gradient_accumulation_steps == 1
    finally:
        acc.end()


def test_torchs_class_members_of_the_prepared_optimizer_are_accelerates():
    from accelerate.optimizer import AcceleratedOptimizer

    from xshard.runtime.prepared import PreparedOptimizer

    for name in ("OptimizerPreHook", "OptimizerPostHook", "profile_hook_step"):
        assert getattr(PreparedOptimizer, name) is getattr(AcceleratedOptimizer, name), name
    assert issubclass(PreparedOptimizer, torch.optim.Optimizer)  # isinstance checks keep working, as on Accelerate's
    public = {n for n in dir(AcceleratedOptimizer) if not n.startswith("_")}
    assert public <= {n for n in dir(PreparedOptimizer) if not n.startswith("_")}


def test_a_deepspeed_plugins_config_shows_the_accumulation_a_script_set():
    import xshard

    acc = xshard.Accelerator(backend="cpu", config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2,
                                                    "train_micro_batch_size_per_gpu": 2, "train_batch_size": 4})
    try:
        acc.gradient_accumulation_steps = 4
        plugin = acc.state.deepspeed_plugin
        assert plugin.gradient_accumulation_steps == 4 == acc.config.gradient_accumulation_steps
        assert (plugin.deepspeed_config["gradient_accumulation_steps"], plugin.deepspeed_config["train_batch_size"]) == (4, 8)
    finally:
        acc.end()
