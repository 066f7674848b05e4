"""One process (world size 1, no process group): option errors, units, and parity of every stage."""

from __future__ import annotations

import pytest
import torch
from support.models import make_qwen2, make_tiny
from support.sharding_harness import assert_matches, case, reference, run_sharded

from xshard.sharding import ShardedModel, ShardingOptions, normalise_stage, shard_model


def test_stage_names_and_bad_stage() -> None:
    assert [normalise_stage(s) for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "2", 1)] == [0, 2, 3, 2, 1]
    with pytest.raises(ValueError) as err:
        ShardingOptions(stage=5)
    assert "stage=5" in str(err.value) and "0, 1, 2, 3" in str(err.value) and "FULL_SHARD" in str(err.value)
    with pytest.raises(ValueError, match="auto_wrap_policy='layers'.*'transformer', 'size', 'none'"):
        ShardingOptions(auto_wrap_policy="layers")
    with pytest.raises(ValueError, match="backward_prefetch='early'"):
        ShardingOptions(backward_prefetch="early")
    with pytest.raises(ValueError, match="param_dtype"):
        ShardingOptions(param_dtype="bf16")


def test_the_plan_is_described_in_one_log_line() -> None:
    """What the log says when a model is sharded: enough to see that hybrid sharding is on."""
    from xshard.sharding import ShardingPlan

    def describe(world: int, local: int | None = None, **options) -> str:
        return ShardingPlan.from_options(ShardingOptions(**options), world, local).describe()

    assert describe(2, stage=0) == "stage 0: replicated on 2 rank(s), gradients all-reduced"
    assert describe(16, 8, stage="HYBRID_SHARD") == ("stage 3: parameters sharded within groups of 8 rank(s), "
                                                    "2 replicas (hybrid); full copies freed after forward")
    assert describe(8, stage=3, reshard_after_forward=4).endswith(
        "freed after forward but for 1/4 on each rank (backward gathers within groups of 4)")
    assert describe(2, stage=2) == ("stage 2: parameters sharded over all 2 rank(s); full copies kept from "
                                    "forward to backward")


def test_unknown_layer_class_lists_the_models_classes(cpu_backend) -> None:
    with pytest.raises(ValueError) as err:
        shard_model(make_tiny(), cpu_backend, ShardingOptions(transformer_layer_cls_to_wrap=["DecoderLayer"]))
    msg = str(err.value)
    assert "DecoderLayer" in msg and "'Block'" in msg and "'TinyLM'" in msg and "'LayerNorm'" in msg


def test_a_model_without_block_classes_is_split_by_size_and_the_log_says_so(cpu_backend, caplog) -> None:
    """Any plain PyTorch model works with the default policy: size-based units instead of an error."""
    plain = torch.nn.Sequential(torch.nn.Linear(3, 30), torch.nn.ReLU(), torch.nn.Linear(30, 3))
    with caplog.at_level("INFO", logger="xshard.sharding"):
        sm = shard_model(plain, cpu_backend, ShardingOptions(min_num_params=90))
    assert [u.name for u in sm.units] == ["<root>", "0", "2"]  # the two Linears (120 and 93 parameters)
    assert "names no block class" in caplog.text and "auto_wrap_policy='size'" in caplog.text
    assert "'Linear'" in caplog.text  # the model's classes, to name one instead


def test_units_and_parameters_are_the_users(cpu_backend) -> None:
    model = make_qwen2()
    params_before = list(model.parameters())
    sm = shard_model(model, cpu_backend, ShardingOptions(stage=3))
    assert isinstance(sm, ShardedModel) and sm.config is model.config  # attributes fall through
    assert [u.name for u in sm.units] == ["<root>", "model.layers.0", "model.layers.1"]
    after = list(sm.parameters())
    assert len(after) == len(params_before) and all(a is b for a, b in zip(after, params_before, strict=True))
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(sm, cpu_backend)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_single_process_matches_plain_pytorch(cpu_backend, stage: int) -> None:
    c = case(stage=stage, micro=2, clip=0.05, frozen=True)
    assert_matches([run_sharded(cpu_backend, 0, 1, c)], reference(c), atol=1e-6, label=f"stage {stage}")


def test_prefetch_is_bounded_by_max_inflight(cpu_backend) -> None:
    from support.models import batch

    ids, labels = batch(0, 4)
    seen = {}
    for limit in (1, 2, 3):
        sm = shard_model(make_tiny(), cpu_backend, ShardingOptions(stage=3, forward_prefetch=True,
                                                                max_inflight_all_gathers=limit))
        for _ in range(2):
            sm.reset_stats()
            sm(ids, labels).backward()
        seen[limit] = sm.stats()["gathers"]
    # the root unit is not counted: with a bound of 1, only the first unit of forward and of
    # backward can be fetched ahead (while the root runs); larger bounds prefetch more
    assert seen[1] == {"prefetched": 2, "peak_in_flight": 1, "passed": 0}
    assert seen[2]["peak_in_flight"] == 2 and seen[2]["prefetched"] > seen[1]["prefetched"]
    assert seen[3]["peak_in_flight"] == 3


def test_devices_without_storage_resize_replace_the_tensor(clean_env) -> None:
    from xshard.backends.devices.cpu import CPUBackend

    class NoResize(CPUBackend):  # what a compiled (XLA-like) device declares
        frees_storage_by_resize = False

    backend = NoResize()
    backend.init_process_group()
    c = case(stage=3, micro=2, clip=0.05)
    assert_matches([run_sharded(backend, 0, 1, c)], reference(c), atol=1e-6, label="no resize")
    sm = shard_model(make_tiny(), backend, ShardingOptions(stage=3))
    with torch.no_grad():
        sm(torch.zeros(1, 3, dtype=torch.long))
    assert all(sp.full.numel() == 0 for u in sm.units for sp in u.params)  # freed by replacement


def test_stage0_mixed_precision_keeps_fp32_master(cpu_backend) -> None:
    c = case(stage=0, optimizer="sgd", micro=2, options=dict(param_dtype=torch.bfloat16))
    assert_matches([run_sharded(cpu_backend, 0, 1, c)], reference(c), atol=2e-2, rtol=2e-2, label="stage0 bf16")
    sm = shard_model(make_tiny(), cpu_backend, ShardingOptions(stage=0, param_dtype=torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in sm.parameters())
    assert sm(torch.zeros(1, 3, dtype=torch.long)).dtype == torch.bfloat16


def test_buffer_dtype_casts_floating_buffers(cpu_backend) -> None:
    model = make_qwen2()
    assert any(b.is_floating_point() for b in model.buffers())
    sm = shard_model(model, cpu_backend, ShardingOptions(stage=3, buffer_dtype=torch.bfloat16))
    assert all(b.dtype == torch.bfloat16 for b in sm.buffers() if b.is_floating_point())


def test_stage3_holds_only_the_root_between_forward_and_backward(cpu_backend) -> None:
    from support.models import batch

    ids, labels = batch(0, 4)
    sm = shard_model(make_tiny(), cpu_backend, ShardingOptions(stage=3))
    root_bytes = sum(sp.full_bytes for sp in sm.units[0].params)
    loss = sm(ids, labels)
    assert sm.stats()["state_bytes"]["unsharded_params"] == root_bytes
    loss.backward()
    after = sm.stats()["state_bytes"]
    assert after["unsharded_params"] == 0 and after["grads"] > 0
    with torch.no_grad():
        sm(ids, labels)
    assert sm.stats()["state_bytes"]["unsharded_params"] == 0  # no backward can follow: root freed too


def test_zero_grad_drops_gradients_accumulated_under_no_sync(cpu_backend) -> None:
    from support.models import batch

    ids, labels = batch(0, 4)
    sm = shard_model(make_tiny(), cpu_backend, ShardingOptions(stage=2))
    with sm.no_sync():
        sm(ids, labels).backward()
    assert sm.stats()["state_bytes"]["grads"] > 0  # full gradients wait for the next synced backward
    sm.zero_grad()
    assert sm.stats()["state_bytes"]["grads"] == 0


class _DataSGD(torch.optim.Optimizer):
    """SGD that writes through ``.data`` (invisible to version counters), as some optimizers do."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def test_registered_optimizer_step_refreshes_compute_copies(cpu_backend) -> None:
    from support.models import batch

    ref = make_tiny()
    sm = shard_model(make_tiny(), cpu_backend, ShardingOptions(stage=2))
    opt, ref_opt = _DataSGD(sm.parameters(), 0.1), _DataSGD(ref.parameters(), 0.1)
    sm.register_optimizer(opt)
    for step in range(3):
        ids, labels = batch(step, 4)
        loss, ref_loss = sm(ids, labels), ref(ids, labels)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        for model, o, value in ((sm, opt, loss), (ref, ref_opt, ref_loss)):
            value.backward()
            o.step()
            model.zero_grad()
