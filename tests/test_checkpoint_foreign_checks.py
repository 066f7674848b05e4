"""Another tool's checkpoint is checked against the live model and optimizer before anything changes: an
Accelerate ``optimizer.bin`` whose ``exp_avg`` is not shaped like its parameter, or whose state is integer
for a float parameter, and a truncated torch.distributed.checkpoint ``.distcp`` file are each one
``CheckpointError`` line naming the file (and the key and the two shapes), the job's weights and
optimizer untouched and every file of the folder still there. One process, in this process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from xshard.checkpoint.files import CheckpointError


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def _accelerate_folder(folder, edit) -> list[str]:
    """What Accelerate's save_state writes for a model that was not FSDP-wrapped, its optimizer state
    changed by ``edit``; returns the folder's files."""
    folder.mkdir()
    model = _net()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = opt.state_dict()
    edit(state["state"][0])  # parameter 0: the first Linear's weight, (64, 8)
    torch.save(state, folder / "optimizer.bin")
    return sorted(p.name for p in folder.iterdir())


def _job(stage: int):
    import xshard

    acc = xshard.Accelerator(config={"stage": stage}, seed=0)
    net = _net()
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # the job's own optimizer state, which a refused load must leave as it was
    opt.zero_grad()
    return acc, model, opt


def _snapshot(model, opt) -> tuple[dict, dict]:
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.optimizer.state.values())}
    return weights, state


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else _same(a[k], b[k])
                                        for k in a)


@pytest.mark.parametrize("stage", [0, 3])
def test_an_accelerate_optimizer_state_of_another_shape_is_refused_before_anything_changes(tmp_path, stage):
    folder = tmp_path / "accelerate_ckpt"
    files = _accelerate_folder(folder, lambda s: s.__setitem__("exp_avg", torch.zeros(3, 3)))
    acc, model, opt = _job(stage)
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError) as caught:
        acc.load_state(folder)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{folder / 'optimizer.bin'}: ")
    assert "'0.weight/exp_avg' has shape (3, 3)" in message and "has shape (64, 8)" in message
    assert "load the optimizer state saved with this model and optimizer" in message
    after = _snapshot(model, opt)
    assert _same(before[0], after[0]) and _same(before[1], after[1])  # nothing was loaded
    assert sorted(p.name for p in folder.iterdir()) == files
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # the job goes on


def test_integer_optimizer_state_for_a_float_parameter_is_refused(tmp_path):
    folder = tmp_path / "accelerate_ckpt"
    _accelerate_folder(folder, lambda s: s.__setitem__("exp_avg_sq", torch.zeros(64, 8, dtype=torch.int64)))
    acc, model, opt = _job(0)
    with pytest.raises(CheckpointError, match=r"optimizer\.bin: optimizer 0 key '0\.weight/exp_avg_sq' is "
                                              r"torch\.int64, but the parameter '0\.weight' is torch\.float32"):
        acc.load_state(folder)


def test_a_truncated_distcp_file_is_a_checkpoint_error_naming_the_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "accelerate_ckpt"
    # Accelerate's SHARDED_STATE_DICT model folder, as DCP writes it, and a plain optimizer.bin
    dcp.save({"model": _net().state_dict()}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True)
    torch.save(torch.optim.AdamW(_net().parameters()).state_dict(), folder / "optimizer.bin")
    data = sorted((folder / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert data
    with open(data[0], "r+b") as f:
        f.truncate(100)  # a copy that stopped early
    files = sorted(p.name for p in (folder / "pytorch_model_fsdp_0").iterdir())
    acc, model, opt = _job(0)
    before = _snapshot(model, opt)
    try:
        acc.load_state(folder)
    except Exception as exc:  # noqa: BLE001 - what a user's `except Exception` sees
        error: BaseException = exc
    else:
        raise AssertionError("a truncated checkpoint loaded")
    assert isinstance(error, CheckpointError)
    message = str(error)
    assert "\n" not in message and str(data[0]) in message
    assert "the folder is damaged or incomplete" in message
    assert _same(before[0], _snapshot(model, opt)[0])
    assert sorted(p.name for p in (folder / "pytorch_model_fsdp_0").iterdir()) == files
