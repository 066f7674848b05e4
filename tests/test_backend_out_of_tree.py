"""A backend from outside xshard brings its device facts with it: adding one touches backends/ (or the
plugin's own package) and the docs only.

``FactsBackend`` below is defined here, outside xshard, and registered the way backends/README.md says a
script registers one (``register_backend`` before the Accelerator is built). Its published peak, its name in
Accelerate's ``DistributedType`` vocabulary and its way of freeing cached memory reach the throughput report,
``accelerator.state.distributed_type`` and ``release_memory`` / ``accelerator.free_memory`` without any
table or branch of xshard knowing the family.
"""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_workers
from support.toy_backend import ToyBackend

from xshard.backends import PeakTable, World, peak_tflops_table, register_backend, unregister_backend

NAME = "factsdev"


class FactsBackend(ToyBackend):
    """A device family of its own ("Facts Chip" on the host CPU, over gloo: the toy backend's host devices)
    with facts of its own."""

    name = NAME
    peak_tflops = PeakTable({"Facts Chip 1": {"fp32": (42.0, "the Facts Chip datasheet")}},
                            ((("facts chip",), "Facts Chip 1"),))
    emptied = 0  # how often this process's cache was emptied

    @classmethod
    def accelerate_distributed_type(cls) -> str:
        return "MULTI_FACTS"

    def device_name(self) -> str:
        return "Facts Chip 1 (64 GB)"

    def empty_cache(self) -> None:
        type(self).emptied += 1


@pytest.fixture
def registered(clean_env):
    register_backend(NAME, FactsBackend)
    yield clean_env
    unregister_backend(NAME)


def _job(rank: int, world_size: int) -> dict:
    from xshard import Accelerator
    from xshard.accelerate_compat.utils import release_memory

    register_backend(NAME, FactsBackend)
    acc = Accelerator(backend=NAME, stage=0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.randn(2, 4)).sum())
        opt.step()
        opt.zero_grad()
    report = acc.throughput()
    out = {"distributed_type": acc.state.distributed_type.value, "peak": (report["peak_tflops"], report["peak_source"])}
    before = FactsBackend.emptied
    release_memory(torch.ones(1))  # Accelerate's function, on the backend this process selects
    acc.free_memory(model, opt)  # the Accelerator's, on its own backend
    out["emptied"] = FactsBackend.emptied - before
    acc.end()
    return out


@pytest.mark.multiprocess
def test_an_out_of_tree_backends_facts_reach_the_report_the_state_and_the_memory_release() -> None:
    results = run_workers(_job, 2, env={"XSHARD_BACKEND": NAME, "XSHARD_PEAK_TFLOPS": ""})
    assert results == [{"distributed_type": "MULTI_FACTS",
                        "peak": (42.0, "Facts Chip 1 fp32: the Facts Chip datasheet"), "emptied": 2}] * 2


def test_a_registered_backends_facts_are_asked_in_this_process(registered) -> None:
    from xshard.accelerate_compat.accelerator_state import DistributedType
    from xshard.accelerate_compat.utils import release_memory
    from xshard.trainer.arguments import XShardDistributedState

    registered.setenv("XSHARD_BACKEND", NAME)
    before = FactsBackend.emptied
    assert release_memory(torch.ones(1), torch.ones(2)) == [None, None]
    assert FactsBackend.emptied == before + 1
    state = XShardDistributedState(FactsBackend(World(rank=0, world_size=2, local_rank=0, local_world_size=2)))
    assert state.distributed_type is DistributedType("MULTI_FACTS") and state.distributed_type == "MULTI_FACTS"
    assert peak_tflops_table().model_of("Facts Chip 1") == "Facts Chip 1"  # the estimate's table has it too
