"""``accelerator.profile()`` against stock Accelerate's, on 2 real processes.

The same snippet (a ``ProfileKwargs`` in ``kwargs_handlers`` with a schedule, ``record_shapes`` and an
``output_trace_dir``; ``prof.step()`` after each training step) runs under stock Accelerate and under
xshard, with xshard's ``ProfileKwargs`` and with Accelerate's own object: each process writes
``profile_<process_index>.json`` in the same folder, a Chrome trace of the schedule's active steps with
the ops' input shapes; ``profile(profile_handler=...)`` overrides the handler. A name the backend cannot
record, or a schedule keyword torch's schedule lacks, is a one-line error naming the valid ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support.distributed import run_workers

pytestmark = pytest.mark.multiprocess

SCHEDULE = {"wait": 1, "warmup": 1, "active": 2}


def _snippet(rank, world_size, library, handler_from, folder):
    if handler_from == "accelerate":
        from accelerate.utils import ProfileKwargs
    else:
        from xshard.utils import ProfileKwargs
    if library == "accelerate":
        from accelerate import Accelerator

        make = lambda **kw: Accelerator(cpu=True, **kw)  # noqa: E731
    else:
        import xshard

        make = lambda **kw: xshard.Accelerator(stage=0, **kw)  # noqa: E731
    handler = ProfileKwargs(activities=["cpu"], schedule_option=SCHEDULE, record_shapes=True,
                            output_trace_dir=str(Path(folder) / "trace"))
    acc = make(kwargs_handlers=[handler])
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    with acc.profile() as prof:
        for _ in range(3):  # waited, warmed up, recorded (the trace holds the recording cycle so far)
            acc.backward(model(torch.ones(4, 8)).sum())
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    with acc.profile(ProfileKwargs(output_trace_dir=str(Path(folder) / "override"))):
        torch.ones(3, 3) @ torch.ones(3, 3)
    acc.wait_for_everyone()
    trace = json.loads((Path(folder) / "trace" / f"profile_{rank}.json").read_text())
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    return {"files": sorted(os.listdir(Path(folder) / "trace")), "override": sorted(os.listdir(Path(folder) / "override")),
            "type": type(prof).__module__ + "." + type(prof).__name__,
            "steps": sorted({e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep#")}),
            "shapes": any(e.get("args", {}).get("Input Dims") for e in ops), "ops": len(ops) > 0}


@pytest.mark.parametrize("handler_from", ["xshard", "accelerate"])
def test_profile_writes_accelerates_trace_files_on_each_process(tmp_path, handler_from):
    reference = run_workers(_snippet, 2, "accelerate", "accelerate", str(tmp_path / "accelerate"))
    ours = run_workers(_snippet, 2, "xshard", handler_from, str(tmp_path / "xshard"))
    assert ours == reference
    assert reference[0]["files"] == ["profile_0.json", "profile_1.json"]
    assert reference[0]["override"] == ["profile_0.json", "profile_1.json"]
    assert reference[0]["type"] == "torch.profiler.profiler.profile"
    assert reference[0]["steps"] == ["ProfilerStep#2", "ProfilerStep#3"]  # wait 1, warmup 1, active 2
    assert reference[0]["shapes"] and reference[0]["ops"]


def test_a_profile_handler_the_backend_cannot_record_is_a_one_line_error(clean_env):
    import xshard
    from xshard.utils import ProfileKwargs

    acc = xshard.Accelerator(backend="cpu", stage=0)
    try:
        assert acc.profile_handler is None
        with pytest.raises(ValueError, match=r"^ProfileKwargs\(activities=\['cuda'\]\): 'cuda' cannot be recorded "
                                             r"on the cpu backend; use \['cpu'\]$"), acc.profile(
                ProfileKwargs(activities=["cuda"])):
            pass
        with pytest.raises(ValueError, match=r"'wiat' is not a torch.profiler.schedule keyword; use wait, warmup, "
                                             r"active, repeat, skip_first$"), acc.profile(
                ProfileKwargs(schedule_option={"wiat": 1})):
            pass
    finally:
        acc.end()
