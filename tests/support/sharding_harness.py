"""Train the same tiny model sharded over N gloo ranks and in one plain PyTorch process, and compare.

A case is a dict (see ``CASE``). ``run_cases`` runs a list of cases inside one spawned job (the
process start-up is the expensive part); ``reference`` trains the same case with plain PyTorch on the
full global batch, no xshard involved.

What is compared (``assert_matches``): the losses, the clip norms, the final parameters AND every
parameter's gradient norm at every step, before clipping. The gradients are what make a wrong scale
visible: AdamW divides a gradient by its own running magnitude, so a gradient 2x (a SUM where an AVG
belongs) or 0.5x too large trains to the same losses and weights, and clipping every step hides it
too. ``reference(case, grad_scale=2.0)`` is the mutation that proves the comparison catches it
(``tests/test_parity_catches_scale.py``).

``forms`` (``run_cases``' last argument) names the collective setup the ranks train through: None is
the CPU backend's own (reduce-scatter by point-to-point exchange, all-gather by broadcasts, AVG as SUM
then divide); ``"cuda"``, ``"npu"``, ``"tpu"`` are the setups those backends declare (the process
group's own reduce-scatter and all-gather over packed buffers; native AVG for CUDA and NPU, SUM then
divide for TPU), run on gloo, which accepts those calls (``declared_forms_backend``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from support.models import batch, make_qwen2, make_tiny, param_groups

CASE: dict[str, Any] = dict(
    stage=3, policy="transformer", model="tiny", tie=True, frozen=False, frozen_prefix=False, reuse=False, steps=3, micro=1, clip=None,
    opt_before=False, groups=True, global_batch=8, options={}, optimizer="adamw", clip_type=2.0,
    hf_checkpointing=False, checkpoint_calls=False, gated=False, sharded_init=False,
)


def case(**kw: Any) -> dict[str, Any]:
    unknown = set(kw) - set(CASE)
    if unknown:
        raise KeyError(f"unknown case keys {unknown}")
    return {**CASE, **kw}


def build(c: dict[str, Any]) -> torch.nn.Module:
    if c["model"] == "qwen2":
        model = make_qwen2()
        if c["hf_checkpointing"]:  # the model's own checkpointing: re-enters module.__call__ in backward
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model = make_tiny(tie=c["tie"], reuse_first=c["reuse"], checkpoint_calls=c["checkpoint_calls"],
                           gated=c["gated"])
    if c["frozen"]:
        for name, p in model.named_parameters():
            # a frozen block weight and a frozen norm: LoRA-style partially frozen units
            if name.endswith("blocks.0.up.weight") or name.endswith("layers.0.mlp.up_proj.weight") \
                    or name.endswith("blocks.1.norm.weight") or name.endswith("layers.1.input_layernorm.weight"):
                p.requires_grad_(False)
    if c["frozen_prefix"]:  # embedding and first block frozen: that unit's output needs no gradient
        for name, p in model.named_parameters():
            if name.startswith(("embed.", "blocks.0.")):
                p.requires_grad_(False)
    return model


def make_optimizer(model: torch.nn.Module, c: dict[str, Any]) -> torch.optim.Optimizer:
    if c["optimizer"] == "sgd":  # low-precision cases: Adam would amplify rounding noise on tiny gradients
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    if c["groups"]:
        return torch.optim.AdamW(param_groups(model), lr=1e-2)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _forward(model: torch.nn.Module, c: dict[str, Any], ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if c["model"] == "qwen2":
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    return model(ids, labels)


def _data(c: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = 61 if c["model"] == "qwen2" else 23
    return batch(step, c["global_batch"], vocab=vocab)


def reference(c: dict[str, Any], grad_scale: float = 1.0) -> dict[str, Any]:
    """Plain PyTorch, one process, full global batch.

    ``grad_scale`` multiplies every gradient before the step: the mutation a wrong average makes
    (2.0: a SUM over 2 ranks; 0.5: a divide done twice), which a comparison must catch.
    """
    model = build(c)
    opt = make_optimizer(model, c)
    losses, norms, grads = [], [], []
    for step in range(c["steps"]):
        for micro in range(c["micro"]):
            ids, labels = _data(c, step * c["micro"] + micro)
            loss = _forward(model, c, ids, labels)
            (loss / c["micro"]).backward()
            losses.append(loss.item())
        if grad_scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        grads.append({name: p.grad.double().norm().item() for name, p in model.named_parameters()
                      if p.grad is not None})
        if c["clip"] is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip"], c["clip_type"]).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "grads": grads,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def gradient_norms(sm) -> dict[str, float]:
    """Each parameter's whole-gradient norm on a sharded model, after the reduce and before clipping.

    At stages 1-3 every rank holds its rows of each gradient: the squares are summed over the shard
    group with torch.distributed itself (not xshard's collectives, whose byte counts and collective
    trace the tests read). Names are the user's (``named_parameters`` of the wrapped module).
    """
    import torch.distributed as dist

    named = list(sm.module.named_parameters())
    squares = torch.zeros(len(named), 2, dtype=torch.float64)  # (sum of squares, holds a gradient)
    for i, (_, p) in enumerate(named):
        if p.grad is not None:
            squares[i, 0] = p.grad.detach().double().pow(2).sum()
            squares[i, 1] = 1.0
    shard = sm.groups.shard
    if sm.plan.shard_parameters and shard.world_size > 1:
        dist.all_reduce(squares, group=shard.group)
    return {name: squares[i, 0].sqrt().item() for i, (name, _) in enumerate(named) if squares[i, 1] > 0}


#: the collective setups a parity job can train through (``forms``), by the backend that declares them
DECLARED_FORMS = ("cuda", "npu", "tpu")


def declared_forms_backend(forms: str):
    """A CPU backend (gloo) whose collectives are built as backend ``forms`` declares them.

    The collective setup is what a device backend declares (``native_avg``, ``collective_options``);
    the collectives themselves are ``DistCollectives`` on every c10d backend, so running that setup on
    gloo trains through the same code the CUDA, NPU and TPU jobs run, with gloo doing the transport.
    """
    from xshard.backends import backend_class, get_backend

    device_cls = backend_class(forms)
    cpu = get_backend("cpu")

    class DeclaredForms(type(cpu)):  # type: ignore[misc]
        native_avg = device_cls.native_avg

        def collective_options(self) -> dict[str, Any]:
            return device_cls.collective_options(self)

    DeclaredForms.__name__ = f"CPUWith{device_cls.__name__}Forms"
    return DeclaredForms()


def init_backend(forms: str | None = None):
    from xshard.backends import get_backend

    backend = get_backend("cpu") if forms is None else declared_forms_backend(forms)
    backend.init_process_group(timeout=60)
    return backend


def run_sharded(backend, rank: int, world_size: int, c: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: returns per-micro-step local losses, clip norms, stats and the full state."""
    from xshard.sharding import ShardingOptions, shard_model, sharded_init

    with sharded_init() if c["sharded_init"] else contextlib.nullcontext():  # parameters on meta until sharded
        model = build(c)
    opt = make_optimizer(model, c) if c["opt_before"] else None
    options = ShardingOptions(stage=c["stage"], auto_wrap_policy=c["policy"], **c["options"])
    sm = shard_model(model, backend, options)
    if opt is not None and c["sharded_init"]:  # built on the meta parameters: rebind, as Accelerator.prepare does
        from xshard.runtime.rebind import rebind_optimizer

        rebind_optimizer(opt, sm.rebound_parameters.new)
    initial = sm.full_state_dict() if c["sharded_init"] else None
    if opt is None:
        opt = make_optimizer(sm, c)
    sm.register_optimizer(opt)
    per = c["global_batch"] // world_size
    losses, norms, comm, grads = [], [], [], []
    for step in range(c["steps"]):
        sm.reset_stats()
        for micro in range(c["micro"]):
            ids, labels = _data(c, step * c["micro"] + micro)
            ids, labels = ids[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]
            sync = micro == c["micro"] - 1
            with contextlib.nullcontext() if sync else sm.no_sync():
                loss = _forward(sm, c, ids, labels)
                (loss / c["micro"]).backward()
            losses.append(loss.item())
        comm.append(sm.stats()["comm"])
        grads.append(gradient_norms(sm))
        if c["clip"] is not None:
            norms.append(sm.clip_grad_norm_(c["clip"], c["clip_type"]).item())
        opt.step()
        opt.zero_grad()
    stats = sm.stats()
    state = sm.full_state_dict()
    shard = sm.groups.shard
    setup = {k: getattr(shard, k, None) for k in ("native_avg", "reduce_scatter_form", "all_gather_via_broadcast")}
    return {"losses": losses, "norms": norms, "grads": grads, "comm": comm, "stats": stats, "collectives": setup, "state": state, "initial": initial,
            "pieces": {k: v.clone() for k, v in sm.sharded_state_dict().items()},
            "units": [(u.name, [sp.spec.fqn for sp in u.params]) for u in sm.units]}


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]],
              forms: str | None = None) -> list[dict[str, Any]]:
    """Worker entry for run_workers: every case in turn on one process group (``forms``: see above)."""
    backend = init_backend(forms)
    try:
        return [run_sharded(backend, rank, world_size, c) for c in cases]
    finally:
        backend.destroy_process_group()


def run_cases_by_forms(rank: int, world_size: int, by_forms: dict[str, list[dict[str, Any]]]
                       ) -> dict[str, list[dict[str, Any]]]:
    """Worker entry for run_workers: each ``forms``' cases on a process group of its own, in turn."""
    return {forms: run_cases(rank, world_size, cases, forms) for forms, cases in by_forms.items()}


def assert_matches(results: list[dict[str, Any]], ref: dict[str, Any], atol: float, rtol: float = 0.0,
                   label: str = "") -> None:
    """Sharded losses (averaged over ranks), clip norms, every step's gradient norms and the final
    parameters match the reference."""
    world = len(results)
    losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), atol=atol, rtol=rtol, msg=lambda m: f"{label} losses: {m}")
    for r in results:
        for a, b in zip(r["norms"], ref["norms"], strict=True):
            assert abs(a - b) <= atol + rtol * abs(b), f"{label}: clip norm {a} vs reference {b}"
    assert_same_gradients(results, ref, atol, rtol, label)
    state = results[0]["state"]
    assert set(state) == set(ref["state"]), f"{label}: keys differ"
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k].float(), v.float(), atol=atol, rtol=rtol,
                                   msg=lambda m, k=k: f"{label} {k} (world {world}): {m}")


#: relative tolerance floor for gradient norms: fp32 sums in another order (per-rank means, then the
#: average) differ from the full batch's in the 6th-7th digit; a wrong scale differs by 50-100%
GRAD_RTOL = 1e-4


def assert_same_gradients(results: list[dict[str, Any]], ref: dict[str, Any], atol: float, rtol: float = 0.0,
                          label: str = "") -> None:
    """Every rank's per-step, per-parameter gradient norms (before clipping) match the reference's:
    the same parameters hold a gradient, and each norm is within ``atol + max(rtol, GRAD_RTOL) * |ref|``."""
    tol = max(rtol, GRAD_RTOL)
    for rank, r in enumerate(results):
        assert len(r["grads"]) == len(ref["grads"]), f"{label}: {len(r['grads'])} steps vs {len(ref['grads'])}"
        for step, (mine, theirs) in enumerate(zip(r["grads"], ref["grads"], strict=True)):
            assert set(mine) == set(theirs), (f"{label} step {step} rank {rank}: gradients on "
                                              f"{sorted(set(mine) ^ set(theirs))} differ in presence")
            for name, b in theirs.items():
                a = mine[name]
                assert abs(a - b) <= atol + tol * abs(b), (
                    f"{label} step {step} rank {rank}: gradient norm of {name} {a} vs reference {b} "
                    f"(ratio {a / b if b else float('inf'):.4f})")


def assert_each_rank_like(results: list[dict[str, Any]], ref: dict[str, Any], atol: float, label: str = "",
                          state_atol: float | None = None) -> None:
    """Ranks that each ran their own batch against one plain process that ran them all (``ref["losses"]``: per
    micro-step, every rank's loss): each rank's losses, the set of parameters holding a gradient and each one's
    norm at every step, the clip norms, and rank 0's final weights (within ``state_atol``, default ``atol``)."""
    tol = f"{label}: " if label else ""
    for rank, r in enumerate(results):
        mine = [losses[rank] for losses in ref["losses"]]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(mine), atol=atol, rtol=0,
                                   msg=lambda m, rank=rank: f"{tol}rank {rank}'s losses: {m}")
        for step, (got, want) in enumerate(zip(r["grads"], ref["grads"], strict=True)):
            assert set(got) == set(want), (f"{tol}step {step}, rank {rank}: parameters with a gradient differ: "
                                           f"{sorted(set(got) ^ set(want))}")
            for name, norm in want.items():
                assert abs(got[name] - norm) <= atol + GRAD_RTOL * norm, \
                    f"{tol}step {step}, rank {rank}, {name}: gradient norm {got[name]} vs {norm}"
        for a, b in zip(r["norms"], ref["norms"], strict=True):
            assert abs(a - b) <= atol + GRAD_RTOL * b, f"{tol}clip norm {a} vs {b}"
    state = results[0]["state"]
    for key, value in ref["state"].items():
        torch.testing.assert_close(state[key], value, atol=atol if state_atol is None else state_atol, rtol=0,
                                   msg=lambda m, key=key: f"{tol}{key}: {m}")
