"""The XLA backend on real torch_xla, one replica on XLA:CPU (PJRT_DEVICE=CPU).

Run in the XLA environment: ``PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla tests/test_xla_*.py``.
"""

from __future__ import annotations

import pytest

torch_xla = pytest.importorskip("torch_xla", reason="needs torch_xla: make test-xla")  # sets PJRT_DEVICE=CPU itself if unset and no TPU

import torch  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

from xshard.backends import BackendUnavailableError, SingleProcessCollectives, get_backend, select  # noqa: E402
from xshard.backends.collectives.xla_graph import XLACollectives  # noqa: E402
from xshard.backends.devices.xla import XLABackend, tpu_detected  # noqa: E402

pytestmark = pytest.mark.xla

# Start the XLA runtime now, at collection: torch's autograd engine sizes its per-device queues at
# the first backward of the process, and an XLA backward after a CPU one that ran before the
# runtime started fails inside the engine (XLABackend() starts the runtime for the same reason).
xr.world_size()


@pytest.fixture
def backend(monkeypatch) -> XLABackend:
    monkeypatch.setenv("XSHARD_BACKEND", "xla")
    b = get_backend()
    assert isinstance(b, XLABackend)
    return b


def test_identity_and_world_come_from_the_runtime(backend: XLABackend) -> None:
    assert (backend.name, backend.device_type, backend.dist_backend) == ("xla", "xla", None)
    assert backend.world.rank == 0 and backend.world.world_size == 1 and backend.world.local_rank == 0
    assert backend.device().type == "xla"
    assert backend.device_count() == 1
    assert backend.launcher().name == "xla"
    assert backend.frees_storage_by_resize is False
    assert backend.runtime_device_type() == "CPU"
    backend.init_process_group()  # no c10d group for XLA: a no-op that must not fail
    facts = backend.describe()
    assert facts["pjrt_device"] == "CPU" and facts["vendor_version"] == torch_xla.__version__.split("+")[0]


@pytest.mark.skipif(tpu_detected(), reason="this machine has a TPU: auto rightly picks XLA")
def test_installed_torch_xla_without_pjrt_device_is_not_picked_by_auto(clean_env) -> None:
    selection = select()
    assert selection.name != "xla"
    assert "PJRT_DEVICE" in dict(selection.skipped)["xla"]
    clean_env.setenv("XSHARD_BACKEND", "xla")
    with pytest.raises(BackendUnavailableError, match="PJRT_DEVICE=TPU"):
        select()


@pytest.mark.skipif(tpu_detected(), reason="this machine has a TPU: auto rightly picks XLA")
def test_xla_on_the_cpu_is_an_explicit_choice(clean_env) -> None:
    clean_env.setenv("PJRT_DEVICE", "CPU")  # what `import torch_xla` sets by itself
    selection = select()
    assert selection.name != "xla" and "XSHARD_BACKEND=xla" in dict(selection.skipped)["xla"]
    clean_env.setenv("XSHARD_BACKEND", "xla")
    assert select().name == "xla"


def test_single_replica_collectives_copy_and_count_bytes(backend: XLABackend) -> None:
    coll = backend.collectives
    assert isinstance(coll, SingleProcessCollectives)
    d = backend.device()
    shard = torch.arange(6.0, device=d)
    full = torch.zeros(6, device=d)
    coll.all_gather_into_tensor(full, shard)
    mine = torch.zeros(2, 3, device=d)
    handle = coll.reduce_scatter_tensor(mine, torch.arange(6.0, device=d) * 2, op="avg", async_op=True)
    assert handle.done  # XLA is lazy: nothing to wait for
    t = torch.full((4,), 3.0, device=d)
    coll.all_reduce(t, op="avg")
    coll.broadcast(t, src=0)
    backend.mark_step()
    # XLA tensors all report data_ptr() == 0: a copy must still happen
    assert torch.equal(full.cpu(), torch.arange(6.0))
    assert torch.equal(handle.wait().cpu(), (torch.arange(6.0) * 2).view(2, 3))
    assert torch.equal(t.cpu(), torch.full((4,), 3.0))
    assert coll.counter.snapshot()["bytes"] == {
        "all_gather": 24, "reduce_scatter": 24, "all_reduce": 2 * 16, "broadcast": 16,
    }


@pytest.mark.parametrize("channel_ids", [False, True])
def test_xla_collectives_on_one_replica_go_through_xm(channel_ids: bool) -> None:
    """The xm.* calls themselves (argument names, shapes) on a one-replica world."""
    coll = XLACollectives(rank=0, world_size=1, channel_ids=channel_ids)
    d = torch_xla.device()
    full = torch.zeros(2, 3, device=d)
    coll.all_gather_into_tensor(full, torch.arange(6.0, device=d))
    mine = torch.zeros(5, device=d)
    coll.reduce_scatter_tensor(mine, torch.arange(5.0, device=d), op="avg")
    reduced = torch.tensor([1.0, -2.0, 3.0], device=d)
    coll.all_reduce(reduced, op="max")
    sent = torch.tensor([float("nan"), 7.0], device=d)
    coll.broadcast(sent, src=0)
    coll.barrier()
    torch_xla.sync()
    assert torch.equal(full.cpu(), torch.arange(6.0).view(2, 3))
    assert torch.equal(mine.cpu(), torch.arange(5.0))
    assert torch.equal(reduced.cpu(), torch.tensor([1.0, -2.0, 3.0]))
    assert torch.equal(sent.cpu()[1:], torch.tensor([7.0])) and sent.cpu()[0].isnan()
    assert coll.counter.snapshot()["calls"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1, "broadcast": 1}


def test_bf16_autocast_matmul(backend: XLABackend) -> None:
    assert backend.supports(torch.bfloat16) and backend.supports(torch.float16)  # XLA:CPU does fp16
    torch.manual_seed(0)
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    d = backend.device()
    with backend.autocast(torch.bfloat16):
        out = a.to(d) @ b.to(d)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), a @ b, atol=0.25, rtol=0.02)


def test_fp16_is_refused_on_tpu_with_the_fix(backend: XLABackend, monkeypatch) -> None:
    monkeypatch.setattr(XLABackend, "runtime_device_type", staticmethod(lambda: "TPU"))
    with pytest.raises(ValueError, match="use bf16"):
        backend.grad_scaler()
    with pytest.raises(ValueError, match="bfloat16"):
        backend.autocast(torch.float16)
    assert backend.supports(torch.bfloat16)


def test_grad_scaler_steps_on_xla_cpu(backend: XLABackend) -> None:
    d = backend.device()
    w = torch.nn.Parameter(torch.ones(3, device=d))
    opt = torch.optim.SGD([w], lr=0.5)
    scaler = backend.grad_scaler()
    scaler.scale((w * torch.tensor([1.0, 2.0, 3.0], device=d)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    backend.mark_step()
    assert torch.allclose(w.detach().cpu(), torch.tensor([0.5, 0.0, -0.5]))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 4)
        self.inner_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner_calls += 1
        return self.out(torch.tanh(self.inner(x)))


def _grads_of(backend: XLABackend, checkpoint: bool, input_grad: bool) -> tuple[list[str], dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    block = _Block().to(backend.device())
    if checkpoint:
        assert backend.checkpoint_wrapper(block) is block
    x = torch.randn(5, 8).to(backend.device()).requires_grad_(input_grad)
    block(x).square().sum().backward()
    backend.mark_step()
    grads = {n: p.grad.cpu() for n, p in block.named_parameters()}
    return [n for n, _ in block.named_parameters()], grads, block.inner_calls


@pytest.mark.parametrize("input_grad", [True, False], ids=["input-requires-grad", "data-input"])
def test_checkpoint_wrapper_keeps_names_and_gradients_and_recomputes(backend: XLABackend, input_grad: bool) -> None:
    # A block fed with data (no input requires grad) is checkpointed too: torch_xla's own
    # checkpoint_module silently runs it without checkpointing (one forward call, no saving).
    names, grads, calls = _grads_of(backend, checkpoint=False, input_grad=input_grad)
    ck_names, ck_grads, ck_calls = _grads_of(backend, checkpoint=True, input_grad=input_grad)
    assert ck_names == names == ["inner.weight", "inner.bias", "out.weight", "out.bias"]
    for n in names:
        torch.testing.assert_close(ck_grads[n], grads[n])
    assert (calls, ck_calls) == (1, 2)  # the checkpointed forward ran again in backward


def test_optimizer_step_patch_steps_once_and_restores(backend: XLABackend) -> None:
    original = xm.optimizer_step
    d = backend.device()
    w = torch.nn.Parameter(torch.zeros(2, device=d))
    opt = torch.optim.SGD([w], lr=1.0)
    (w * torch.tensor([1.0, 2.0], device=d)).sum().backward()
    with backend.optimizer_step_patch() as patch:
        assert xm.optimizer_step is not original and patch.original is original
        xm.optimizer_step(opt, barrier=True, optimizer_args={})
    assert xm.optimizer_step is original
    patch.restore()  # idempotent
    assert xm.optimizer_step is original
    assert torch.equal(w.detach().cpu(), torch.tensor([-1.0, -2.0]))


def test_optimizer_step_hook_is_step_then_mark_step(backend: XLABackend) -> None:
    import torch_xla.debug.metrics as met

    d = backend.device()
    w = torch.nn.Parameter(torch.ones(2, device=d))
    opt = torch.optim.SGD([w], lr=1.0)
    (w * 3).sum().backward()
    backend.mark_step()
    steps = met.counter_value("MarkStep") or 0
    backend.optimizer_step(opt)
    assert met.counter_value("MarkStep") == steps + 1
    assert torch.equal(w.detach().cpu(), torch.tensor([-2.0, -2.0]))


def test_dataloader_delivers_batches_on_the_device(backend: XLABackend) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(8.0).view(4, 2))
    loader = backend.wrap_dataloader(torch.utils.data.DataLoader(data, batch_size=2))
    batches = [b for (b,) in loader]
    assert [b.device.type for b in batches] == ["xla", "xla"]
    assert torch.equal(torch.cat([b.cpu() for b in batches]), torch.arange(8.0).view(4, 2))


def test_seed_and_rng_state_round_trip(backend: XLABackend) -> None:
    d = backend.device()
    backend.manual_seed(1234)
    state = backend.rng_state()
    first = torch.rand(4, device=d).cpu()
    backend.set_rng_state(state)
    again = torch.rand(4, device=d).cpu()
    assert torch.equal(first, again)
    backend.manual_seed(1234)
    assert torch.equal(torch.rand(4, device=d).cpu(), first)
    assert backend.memory_stats().keys() == {"allocated", "peak"}


def test_optimizer_step_patch_is_counted_across_holders(backend: XLABackend) -> None:
    """Replicas that are threads of one process each hold the patch; the last release restores."""
    original = xm.optimizer_step
    first, second = backend.optimizer_step_patch(), backend.optimizer_step_patch()
    assert first.replacement is second.replacement is xm.optimizer_step
    first.restore()
    assert xm.optimizer_step is second.replacement
    second.restore()
    assert xm.optimizer_step is original
