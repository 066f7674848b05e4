"""Process groups from torchrun's environment: one process without variables, timeouts, joining an
existing group, teardown, and malformed launcher variables."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from support.distributed import run_workers

from xshard.backends import SingleProcessCollectives, World, WorldEnvironmentError, backend_class
from xshard.backends.cluster import detect

CPU = backend_class("cpu")


def test_one_process_with_no_variables(clean_env) -> None:
    backend = CPU()
    assert backend.world == World(0, 1, 0, 1)
    backend.init_process_group()
    assert not dist.is_initialized()
    t = torch.tensor([3.0])
    backend.collectives.all_reduce(t, op="avg")
    assert isinstance(backend.collectives, SingleProcessCollectives) and t.item() == 3.0
    backend.destroy_process_group()


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 is negative"),
])
def test_malformed_launcher_variables(env: dict, message: str) -> None:
    with pytest.raises(WorldEnvironmentError, match=message):
        detect(env)


@pytest.mark.parametrize("timeout", [0, -5, "soon"])
def test_bad_timeout(clean_env, timeout) -> None:
    with pytest.raises(ValueError, match="timeout"):
        CPU(World(0, 2, 0, 2)).init_process_group(timeout=timeout)


def test_existing_group_of_another_size_is_refused(clean_env) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(WorldEnvironmentError, match="already running as rank 0 of 1.*rank 0 of 2"):
            CPU(World(0, 2, 0, 2)).init_process_group()
    finally:
        dist.destroy_process_group()


def _job(rank: int, world_size: int) -> dict:
    backend = CPU()
    backend.init_process_group(timeout=45)
    gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    group_timeout = gloo.options._timeout
    t = torch.tensor([float(rank)])
    backend.collectives.all_reduce(t, op="sum")
    again = CPU()
    again.init_process_group()  # joins the running group instead of starting a second one
    owned = (backend._owns_process_group, again._owns_process_group)
    again.destroy_process_group()  # not its group: must leave it running
    still_up = dist.is_initialized()
    backend.destroy_process_group()
    return {"sum": t.item(), "owned": owned, "still_up": still_up, "down": not dist.is_initialized(),
            "timeout": group_timeout}


@pytest.mark.multiprocess
def test_two_processes_start_share_and_tear_down() -> None:
    for out in run_workers(_job, 2, timeout=120):
        assert out["sum"] == 1.0
        assert out["owned"] == (True, False)
        assert out["still_up"] and out["down"]
        assert out["timeout"] == datetime.timedelta(seconds=45)
